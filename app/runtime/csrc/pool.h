/* A pool of one worker per extra core that runs a task's parts beside its caller. */
#pragma once

/* Part `part` of `parts` of a task; each part writes only its own outputs. */
typedef void (*pool_task)(const void *task, int part, int parts);

/* Run parts 0..parts-1 of `task`, the caller taking part 0. A task that finds the pool
   busy (another thread's task) runs all its parts on its caller: slower, never wrong. */
void pool_run(pool_task fn, const void *task);

/* How many parts a task is cut into: the cores this process may run on, at most 8. */
int pool_parts(void);

/* Around a call that runs on another library's threads (the BLAS's): pool_quiet(1) before,
   pool_quiet(0) after. While any is under way, idle workers sleep at once instead of
   spinning on the cores those threads need. */
void pool_quiet(int begins);
