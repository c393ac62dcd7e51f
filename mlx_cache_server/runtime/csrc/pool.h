/* A pool of one worker per extra core that runs a task's chunks beside its caller. */
#pragma once

/* Chunk `chunk` of a task; each chunk writes only its own outputs. */
typedef void (*pool_task)(const void *task, int chunk);

/* Run chunks 0..chunks-1 of `task` (at most 65535), each taken by whichever thread is
   free next, the caller among them: a worker the system has put off leaves its share to
   the others rather than holding the caller up. A task that finds the pool busy (another
   thread's task) runs all its chunks on its caller: slower, never wrong. */
void pool_run(pool_task fn, const void *task, int chunks);

/* How many threads run a task: the cores this process may run on, at most 8. */
int pool_parts(void);

/* Around a call that runs on another library's threads (the BLAS's): pool_quiet(1) before,
   pool_quiet(0) after. While any is under way, idle workers sleep at once instead of
   spinning on the cores those threads need. */
void pool_quiet(int begins);

/* How many products are under way on the BLAS's own threads (tests read it). */
int mlxcs_pool_quiet(void);
