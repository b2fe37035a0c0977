/* The replay loop of a CPU graph (compile_runtime/cudagraph/cpu_graph.py): the native calls
 * one captured step made, in order, called again with the same arguments, no Python between.
 *
 * Call i is fns[i] with nargs[i] arguments, taken in order from args (every argument is an
 * integer or a pointer: the recorder refuses anything else). A function of fewer arguments
 * is called through a prototype of 8, 16, 32 or 64 integer arguments, the extra ones zero:
 * integer arguments travel in registers and then in stack slots the caller owns and
 * clears (x86-64 System V, AArch64), so a callee never sees the ones it does not declare. */
#include <stdint.h>

#include "graph_replay.h"

typedef int64_t I;
typedef void (*fn8)(I, I, I, I, I, I, I, I);
typedef void (*fn16)(I, I, I, I, I, I, I, I, I, I, I, I, I, I, I, I);
#define A8(a) a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
#define A16(a) A8(a), A8((a + 8))
#define A32(a) A16(a), A16((a + 16))
#define A64(a) A32(a), A32((a + 32))
#define T8 I, I, I, I, I, I, I, I
#define T16 T8, T8
#define T32 T16, T16
typedef void (*fn32)(T32);
typedef void (*fn64)(T32, T32);

#define MAX_ARGS 64

int64_t graph_max_args(void) { return MAX_ARGS; }

/* Returns the number of calls made: ncalls, or the index of the first call with more than
 * MAX_ARGS arguments (never recorded: the recorder checks graph_max_args first). */
int64_t graph_replay(void* const* fns, const int64_t* nargs, const int64_t* args, int64_t ncalls) {
    I a[MAX_ARGS];
    for (int64_t i = 0; i < ncalls; i++) {
        const int64_t n = nargs[i];
        if (n > MAX_ARGS) return i;
        int64_t j = 0;
        for (; j < n; j++) a[j] = args[j];
        const int64_t width = n <= 8 ? 8 : n <= 16 ? 16 : n <= 32 ? 32 : 64;
        for (; j < width; j++) a[j] = 0;
        args += n;
        switch (width) {
            case 8: ((fn8)fns[i])(A8(a)); break;
            case 16: ((fn16)fns[i])(A16(a)); break;
            case 32: ((fn32)fns[i])(A32(a)); break;
            default: ((fn64)fns[i])(A64(a)); break;
        }
    }
    return ncalls;
}
