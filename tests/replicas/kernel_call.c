/* Calls one function of a kernel library by name, with its arguments from the command line, and
   writes its buffers back: how the tests run a build for another CPU (aarch64 NEON and SVE, under
   qemu-user) where neither Python nor torch runs. tests/replicas/test_cross_isa.py drives it.

       kernel_call LIB FUNCTION RET ARG...

   RET is `i` (the function returns an int) or `d` (a double); it is printed on stdout. Each ARG
   is `b:PATH` (a buffer read from the file PATH, whose address is passed and whose bytes are
   written back to PATH after the call), `n` (NULL), `i:VALUE` (an int64_t or int) or
   `f:VALUE` (a float).

   The kernels' arguments are pointers, int64_t, int and float. On both AAPCS64 and the x86-64
   SysV ABI the integer-class ones take the integer registers and then 8-byte stack slots in
   order, and floats take the vector registers in order, independently of where they stand in
   the list; so calling every function through one type with 24 integer and 4 float parameters
   passes each argument where the callee reads it (the ones it does not take are ignored). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define INTS 24
#define FLOATS 4
#define U uint64_t
typedef int (*int_fn)(U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U,
                      float, float, float, float);
typedef double (*double_fn)(U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U, U,
                            U, float, float, float, float);

struct buffer {
    const char *path;
    void *data;
    size_t size;
};

static void *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *size = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    /* 64-byte aligned, as torch's CPU allocator gives the kernels; at least one byte */
    void *data = aligned_alloc(64, (*size + 64) / 64 * 64);
    if (data && fread(data, 1, *size, f) != *size) {
        free(data);
        data = NULL;
    }
    fclose(f);
    return data;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: kernel_call LIB FUNCTION RET ARG...\n");
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    void *fn = dlsym(lib, argv[2]);
    if (!fn) {
        fprintf(stderr, "dlsym %s: %s\n", argv[2], dlerror());
        return 2;
    }
    U ints[INTS] = {0};
    float floats[FLOATS] = {0};
    struct buffer buffers[INTS];
    int n_ints = 0, n_floats = 0, n_buffers = 0;
    for (int a = 4; a < argc; a++) {
        const char *arg = argv[a];
        if (arg[0] == 'f' && arg[1] == ':') {
            if (n_floats == FLOATS) return fprintf(stderr, "too many floats\n"), 2;
            floats[n_floats++] = strtof(arg + 2, NULL);
            continue;
        }
        if (n_ints == INTS) return fprintf(stderr, "too many arguments\n"), 2;
        if (arg[0] == 'n' && arg[1] == '\0') {
            ints[n_ints++] = 0;
        } else if (arg[0] == 'i' && arg[1] == ':') {
            ints[n_ints++] = (U)strtoll(arg + 2, NULL, 10);
        } else if (arg[0] == 'b' && arg[1] == ':') {
            struct buffer *b = &buffers[n_buffers++];
            b->path = arg + 2;
            b->data = read_file(b->path, &b->size);
            if (!b->data) return fprintf(stderr, "cannot read %s\n", b->path), 2;
            ints[n_ints++] = (U)(uintptr_t)b->data;
        } else {
            fprintf(stderr, "bad argument %s\n", arg);
            return 2;
        }
    }
#define ARGS                                                                                     \
    ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6], ints[7], ints[8], ints[9],     \
        ints[10], ints[11], ints[12], ints[13], ints[14], ints[15], ints[16], ints[17], ints[18], \
        ints[19], ints[20], ints[21], ints[22], ints[23], floats[0], floats[1], floats[2],       \
        floats[3]
    if (strcmp(argv[3], "d") == 0)
        printf("%.17g\n", ((double_fn)fn)(ARGS));
    else
        printf("%d\n", ((int_fn)fn)(ARGS));
    for (int i = 0; i < n_buffers; i++) {
        FILE *f = fopen(buffers[i].path, "wb");
        if (!f || fwrite(buffers[i].data, 1, buffers[i].size, f) != buffers[i].size) {
            fprintf(stderr, "cannot write %s\n", buffers[i].path);
            return 2;
        }
        fclose(f);
        free(buffers[i].data);
    }
    return 0;
}
