/* fail_alloc.h — see fail_alloc.c. */
#ifndef DION3_TESTS_FAIL_ALLOC_H
#define DION3_TESTS_FAIL_ALLOC_H
/* From now on, the nth allocation fails (persistent: and every later one). */
void fail_alloc_arm(long nth, int persistent);
/* Stops failing; returns how many allocations failed since fail_alloc_arm. */
long fail_alloc_disarm(void);
#endif
