# cuda_graph.py — dion3.cuda_graph.CudaGraphOptimizer: the optimizer step captured once in a CUDA
# graph and replayed, with the reference package's interface (dion.cuda_graph), so that moving
# over is an import change.
#
# The engine's kernels read every group hyper-parameter (lr, weight decay, momentum, betas,
# epsilon) from device memory; before each replay, outside the graph, this wrapper writes the
# groups' current values there. A torch.optim.lr_scheduler bound to the wrapper or to the inner
# optimizer, a hand-written group["lr"] = ..., or a weight-decay schedule all take effect on the
# next replay, with nothing to opt into.
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable, Optional

import torch

from .optimizer import CaptureNotReady, _EngineOptimizer


class CudaGraphOptimizer(torch.optim.Optimizer):
    """Runs `optimizer.step()` eagerly for `warmup_steps` steps, then captures one step in a
    CUDA graph and replays it. The gradients must stay in the same memory (zero_grad zeroes them
    in place). A change the graph cannot follow (parameters, groups, fraction, split_sizes,
    nesterov, cautious_wd, selection_scope, the orthogonalizer, a loaded state, gradients in other
    memory) is noticed at the next step, which then runs eagerly and captures again after warm-up. Call release() before torch.distributed.destroy_process_group()
    under NCCL: a captured graph holds the step's collectives."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 10):
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
            raise ValueError(f"dion3: warmup_steps must be an integer >= 1 (eager steps allocate the state and "
                             f"workspace that the captured step then reuses); got {warmup_steps!r}")
        if not isinstance(optimizer, _EngineOptimizer):
            raise TypeError(f"dion3: CudaGraphOptimizer wraps a dion3 optimizer (Dion3, NorMuon, Muon); got "
                            f"{type(optimizer).__name__}")
        # Optimizer.__init__ is not called: state and groups stay the inner optimizer's; the hook
        # registries torch reads in step() and state_dict() are made here.
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self._steps = 0
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._warned = False
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())

    def __getattr__(self, name):
        # "optimizer" is not yet set while unpickling (no recursion); the copy and pickle protocol's
        # names (__deepcopy__, __reduce_ex__, ...) are the wrapper's own, not the inner optimizer's.
        if name == "optimizer" or name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self):
        # A captured graph is this process's and these buffers': a copy warms up and captures anew.
        # An lr scheduler's patched `step` (an instance attribute bound to this object) stays behind.
        state = dict(self.__dict__, _graph=None, _steps=0)
        state.pop("step", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)  # not torch's Optimizer.__setstate__: the groups are the inner's

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    @property
    def captured(self) -> bool:
        """Whether the next step replays a captured graph."""
        return self._graph is not None

    def add_param_group(self, param_group) -> None:
        self._warm_up_again()  # the new parameters' state is made by eager steps
        self.optimizer.add_param_group(param_group)

    # torch's Optimizer.state_dict / load_state_dict call the hooks registered on this object
    # around the inner optimizer's (whose own hooks run inside).
    def state_dict(self):
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = self.optimizer.state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict) -> None:
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._warm_up_again()  # the state tensors are replaced: the graph would write the old ones
        self.optimizer.load_state_dict(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def zero_grad(self, set_to_none: bool = False) -> None:
        if set_to_none and not self._warned:
            self._warned = True
            warnings.warn("dion3: CudaGraphOptimizer zeroes gradients in place (set_to_none=True would give the "
                          "replayed step tensors it never reads)", RuntimeWarning, stacklevel=2)
        self.optimizer.zero_grad(set_to_none=False)

    def release(self) -> None:
        """Drop the captured graph (and the collectives it holds); the next step runs eagerly and
        captures again after it."""
        if self._graph is not None:
            torch.cuda.synchronize()
            self._graph.reset()
            self._graph = None
        # An eager step plans for what changed (a capture cannot); warm-up that has not ended stays as it is.
        self._steps = min(self._steps, self.warmup_steps - 1)

    def _warm_up_again(self) -> None:
        """Drop the graph; capture again after warmup_steps eager steps."""
        self.release()
        self._steps = 0

    def _check_capturable(self) -> None:
        for gi, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                name = self.optimizer._param_name(group, gi, j)
                if p.device.type != "cuda":
                    raise RuntimeError(f"dion3: cannot capture the step: parameter {j} '{name}' of group {gi} is on "
                                       f"{p.device}; a CUDA graph captures steps of CUDA parameters (step the "
                                       "optimizer itself elsewhere)")
                if p.device.index != torch.cuda.current_device():
                    # torch.cuda.graph captures the current device's stream; the engine steps on its own device's.
                    raise RuntimeError(f"dion3: cannot capture the step: parameter {j} '{name}' of group {gi} is on "
                                       f"{p.device} but the current device is cuda:{torch.cuda.current_device()}; "
                                       f"call torch.cuda.set_device({p.device.index}) first")
                if p.requires_grad and p.grad is None:
                    raise RuntimeError(
                        f"dion3: cannot capture the step: parameter {j} '{name}' of group {gi} requires grad but has "
                        "no gradient, so the captured step could never update it; give every such parameter a "
                        "gradient (zero_grad(set_to_none=False) after a backward that reaches it), or set "
                        "requires_grad=False")

    def _capture(self) -> None:
        self._check_capturable()
        inner = self.optimizer
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            # A capture the engine declines records nothing; PyTorch's warning about the empty
            # graph would only alarm the user.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                with torch.cuda.graph(graph):
                    inner.step()
        except CaptureNotReady:
            # The parameters with gradients changed since the last eager step: take this one
            # eagerly (the engine is rebuilt for them) and capture at the next.
            inner.step()
            return
        self._graph = graph
        inner.refresh_hyperparameters()
        graph.replay()  # capture records the step; this runs it

    # Wrapped as torch wraps its optimizers' step (Optimizer.__init__, not called here, would): the
    # step hooks registered on this object, and the global ones, run around each call (the global
    # ones also around the inner optimizer's eager steps, as for any optimizer calling another).
    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure: Optional[Callable] = None):
        """One step: eager during warm-up, then captured once and replayed."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._graph is not None:
            try:
                self.optimizer.refresh_hyperparameters()
            except RuntimeError:
                self._warm_up_again()  # something the graph cannot follow changed
        if self._graph is not None:
            self._graph.replay()
        elif self._steps < self.warmup_steps:
            self.optimizer.step()
        else:
            self._capture()
        self._steps += 1
        return loss

    step.hooked = True  # already wrapped: torch's _patch_step_function must not wrap it again
