/* What graph_replay.c exports: each function's one declaration, which graph_replay.c is
 * checked against and ctypes is typed from (compile_runtime/ops/c_header.py). */
#pragma once
#include <stdint.h>

/* The most arguments a replayed call may take. */
int64_t graph_max_args(void);
/* Calls fns[0..ncalls) in order, call i with the next nargs[i] values of args; returns the
 * number of calls made (graph_replay.c says how a call with fewer arguments is made). */
int64_t graph_replay(void* const* fns, const int64_t* nargs, const int64_t* args, int64_t ncalls);
