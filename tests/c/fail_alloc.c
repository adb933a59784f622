/* fail_alloc.c — a malloc that fails on request, linked into c_api_out_of_memory (glibc only): it
 * replaces malloc, calloc, realloc and the aligned allocations for the whole process (operator new
 * calls malloc), passing them to glibc's own until armed. */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "fail_alloc.h"

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);

static long armed_nth, seen, failed;
static int armed, from_then_on;

void fail_alloc_arm(long nth, int persistent) {
  seen = failed = 0;
  armed_nth = nth;
  from_then_on = persistent;
  armed = 1;
}

long fail_alloc_disarm(void) {
  armed = 0;
  return failed;
}

static int fails(void) {
  if (!armed) return 0;
  ++seen;
  if (seen == armed_nth || (from_then_on && seen > armed_nth)) {
    ++failed;
    errno = ENOMEM;
    return 1;
  }
  return 0;
}

void* malloc(size_t n) { return fails() ? NULL : __libc_malloc(n); }
void* calloc(size_t a, size_t b) { return fails() ? NULL : __libc_calloc(a, b); }
void* realloc(void* p, size_t n) { return n && fails() ? NULL : __libc_realloc(p, n); }
void* memalign(size_t al, size_t n) { return fails() ? NULL : __libc_memalign(al, n); }
void* aligned_alloc(size_t al, size_t n) { return fails() ? NULL : __libc_memalign(al, n); }
int posix_memalign(void** out, size_t al, size_t n) {
  if (fails()) return ENOMEM;
  void* p = __libc_memalign(al, n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
