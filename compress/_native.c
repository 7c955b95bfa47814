/* Optional CPU kernels for the blockwise codecs (compress/codecs/blockwise.py: int8; block4.py:
 * the 4-bit codecs) and for compress/fingerprint.py.
 *
 * Each kernel does in one or two passes over a block what the torch path does in many, and must
 * give the same bits: the same fp32 operations in the same order (no FMA contraction: built with
 * -ffp-contract=off), with round-to-nearest-even. tests/compress/test_compress_native.py checks
 * bit-identity against the torch path, which stays the reference (and the path for CUDA tensors).
 *
 * Pointers are passed as integers (tensor.data_ptr()); the caller checks dtypes, contiguity and
 * sizes. encode (int8) and encode4 (the 4-bit codecs) return 0, or 1 if the input holds a NaN or
 * an infinity; decode8 and decode4s decode them; has_nibble looks for a code no encoder writes;
 * fingerprint32 is the integer sum behind compress.fingerprint (tests/compress/test_fingerprint.py);
 * shuffle and unshuffle are the byte transposes of compress/entropy.py.
 * All release the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* the block loops are compiled for AVX-512 (x86-64-v4, GCC 12 on), AVX2 and baseline x86-64 and
 * picked at load time; the per-block helpers are inlined into each. -DNATIVE_ONE_TARGET builds
 * one version for the compiler's -march (tests/compress/test_compress_native_isa.py builds each) */
#if defined(NATIVE_ONE_TARGET) || !defined(__GNUC__) || !defined(__x86_64__) || defined(__clang__)
#define CLONES
#elif __GNUC__ >= 12
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define CLONES __attribute__((target_clones("avx2", "default")))
#endif
#define INLINE static inline __attribute__((always_inline))

#define MAGIC 12582912.0f /* 1.5 * 2^23: adding it rounds |y| < 2^22 to an integer (RNE) */
#define TINY 7.888609052210118e-31f /* 2^-100, the smallest absmax a scale is derived from */

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* max |x| over m values as fp32 bits (sign cleared); >= 0x7f800000 means inf or NaN */
INLINE uint32_t absmax_bits(const float *x, int64_t m) {
    const uint32_t *u = (const uint32_t *)x;
    int32_t mx = 0;
    for (int64_t i = 0; i < m; i++) {
        int32_t a = (int32_t)(u[i] & 0x7fffffffu);
        mx = a > mx ? a : mx;
    }
    return (uint32_t)mx;
}

/* scale = max(absmax, 2^-100) / q and inv = (1 / scale) * gain, exactly as the torch path, for
 * g blocks of m values; 1 if a block holds inf or NaN. The scales are computed after all the
 * absmaxes so that the divisions of several blocks overlap (and vectorize). */
INLINE int group_scales(const float *x, int64_t g, int64_t m, float q, float gain, float *scale,
                        float *inv) {
    uint32_t bad = 0;
    for (int64_t j = 0; j < g; j++) {
        uint32_t am = absmax_bits(x + j * m, m);
        bad |= am >= 0x7f800000u;
        scale[j] = float_of(am);
    }
    if (bad) return 1;
    for (int64_t j = 0; j < g; j++) {
        float a = scale[j];
        scale[j] = (a < TINY ? TINY : a) / q;
    }
    for (int64_t j = 0; j < g; j++) {
        float r = 1.0f / scale[j];
        inv[j] = gain == 1.0f ? r : r * gain;
    }
    return 0;
}

/* low byte of bits(x * inv + add): the int8 codes (add = MAGIC) */
INLINE void int_codes(const float *x, int64_t m, float inv, float add, uint8_t *c) {
    for (int64_t i = 0; i < m; i++) c[i] = (uint8_t)bits_of(x[i] * inv + add);
}

/* codes of 4-bit codecs: pairs into bytes, element 2i in the low nibble */
INLINE void pack_pairs(const uint8_t *c, int64_t m, uint8_t *out) {
    for (int64_t i = 0; i < m / 2; i++)
        out[i] = (uint8_t)((c[2 * i] & 15u) | (uint8_t)(c[2 * i + 1] << 4));
}

enum { K_INT8 = 0 };

#define GROUP 8192 /* values per group of blocks: the group's input stays in cache between passes */

/* int8: the scales and codes of n values in blocks of `block`: per group of blocks, all scales
 * first, then the codes block by block */
CLONES static int encode_blocks(int kind, const float *x, int64_t n, int64_t block, float q,
                                float gain, float add, float *scales, uint8_t *codes) {
    float inv[GROUP];
    int64_t nb = (n + block - 1) / block, per = block < GROUP ? GROUP / block : 1;
    (void)kind;
    for (int64_t b0 = 0; b0 < nb; b0 += per) {
        int64_t g = nb - b0 < per ? nb - b0 : per, s = b0 * block;
        int64_t whole = s + g * block > n ? g - 1 : g; /* the frame's last block may be short */
        if (whole && group_scales(x + s, whole, block, q, gain, scales + b0, inv)) return 1;
        if (whole < g && group_scales(x + s + whole * block, 1, n - s - whole * block, q, gain,
                                      scales + b0 + whole, inv + whole)) return 1;
        for (int64_t j = 0; j < g; j++) {
            int64_t s0 = (b0 + j) * block, m = n - s0 < block ? n - s0 : block;
            int_codes(x + s0, m, inv[j], add, codes + s0);
        }
    }
    return 0;
}

/* encode(kind, x, n, block, q, gain, add, scales, codes) -> 0 / 1 (non-finite input) */
static PyObject *encode(PyObject *self, PyObject *args) {
    int kind, bad;
    unsigned long long px, ps, pc;
    Py_ssize_t n, block;
    float q, gain, add;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKnnfffKK", &kind, &px, &n, &block, &q, &gain, &add, &ps, &pc))
        return NULL;
    if (kind != K_INT8) {
        PyErr_SetString(PyExc_ValueError, "encode: only int8 (kind 0)");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    bad = encode_blocks(kind, (const float *)(uintptr_t)px, n, block, q, gain, add,
                        (float *)(uintptr_t)ps, (uint8_t *)(uintptr_t)pc);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(bad);
}

/* int8: code times its block's scale, for n values in blocks of `block` */
CLONES static void decode8_blocks(const int8_t *codes, int64_t n, int64_t block,
                                  const float *scales, float *out) {
    for (int64_t s = 0, j = 0; s < n; s += block, j++) {
        int64_t m = n - s < block ? n - s : block;
        float sc = scales[j];
        for (int64_t i = 0; i < m; i++) out[s + i] = (float)codes[s + i] * sc;
    }
}

/* decode8(codes, n, block, scales, out) */
static PyObject *decode8(PyObject *self, PyObject *args) {
    unsigned long long pc, ps, po;
    Py_ssize_t n, block;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnnKK", &pc, &n, &block, &ps, &po)) return NULL;
    if (block < 1) {
        PyErr_SetString(PyExc_ValueError, "decode8: bad block");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode8_blocks((const int8_t *)(uintptr_t)pc, n, block, (const float *)(uintptr_t)ps,
                   (float *)(uintptr_t)po);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- 4-bit codecs, layout 2: an fp32 anchor per group of blocks, an 8-bit scale code per block
 *
 * A group of G blocks has the anchor A = max(absmax of the group, floor); block b's scale is
 * u = A * U[k_b] (fp32) with U a 256-entry table (the caller's: 2^(2 - k/8) / qn as fp32) and
 * k_b its scale code. A magnitude a = |x| is coded from y = a * (1 / u) by the family's rule
 * (below) to an index m in 0..7 whose level lev[m] decodes to lev[m] * u. k0 is the largest code
 * whose scale maps the block's absmax to at most qn units: absmax <= (A * U[k0]) * qn. Round to
 * nearest picks k_b among k0 - lo .. k0 + hi (clamped to the codes allowed): the one whose block
 * error is smallest, measured exactly in fixed point -- each value's error (y - lev[m]) * w,
 * with w = u * (256 / scale of the first candidate), rounded to an integer and squared (|.| <=
 * 2^11); integer sums do not depend on the order of the additions, so the torch path finds the
 * same minimum -- the first on ties. Codes whose top level would overflow (an anchor near float
 * max) are never candidates.
 *
 * Family rules (the torch path does the same fp32 operations):
 *   int4   r = min(y, 7) + MAGIC: m = the low bits of r, lev[m] = r - MAGIC (nearest, ties even);
 *          nibble = round(clamp(x * (1/u), -7, 7)) + 8, offset binary (0 is never written)
 *   e2m1   z = min(y, 6) rounded to 1 mantissa bit, steps no finer than 1/2: adding then
 *          subtracting c = 2^22 * max(2^exponent(z), 1) (ties even); m from its bits
 *   e3m0   z = min(max(y * 4/3, 2^-7), 1.5); m = the low 3 bits of z's exponent, lev[m] = 2^that
 *          exponent (0 below 2^-6)
 *   table  m = number of the 7 thresholds <= y (lloyd4: nearest level, ties up)
 * and the last three write sign-magnitude nibbles m | sign << 3, the sign only where m > 0 (8,
 * minus zero, is never written). */

#define SEARCH_RES 256.0f
#define CHUNK4 8192 /* codes are paired from a scratch of this many bytes (even) */
#define MAXWIN 16   /* candidates per block at most */
enum { F_INT4 = 0, F_E2M1 = 1, F_E3M0 = 2, F_TABLE = 3 };

typedef struct {
    float thr[7], lev[8];
} levels4;

/* per family: from y (>= 0) set uint32_t q (index) and float v (level, in units). e2m1: with
 * E = max(exponent(z), 0), r = z + 2^(22+E) holds round(z / 2^(E-1)) in its low mantissa bits,
 * and the index is that plus 2E (E = 0: 0..4, E = 1: 2..4 + 2, E = 2: 2..3 + 4) */
#define MAG_INT4(y)                                                                            \
    float r_ = ((y) < 7.0f ? (y) : 7.0f) + MAGIC;                                              \
    uint32_t q = bits_of(r_) - 0x4b400000u;                                                    \
    float v = r_ - MAGIC;
#define MAG_E2M1(y)                                                                            \
    float z_ = (y) < 6.0f ? (y) : 6.0f;                                                        \
    uint32_t e_ = bits_of(z_) & 0x7f800000u;                                                   \
    uint32_t ce_ = (e_ > 0x3f800000u ? e_ : 0x3f800000u) + (22u << 23);                        \
    float c_ = float_of(ce_);                                                                  \
    float r_ = z_ + c_;                                                                        \
    float v = r_ - c_;                                                                         \
    uint32_t q = bits_of(r_) - ce_ + (ce_ >> 22) - 298u;
#define MAG_E3M0(y)                                                                            \
    float z_ = (y) * 1.33333337306976318359375f; /* fp32(4/3) */                               \
    z_ = z_ > 0.0078125f ? z_ : 0.0078125f;                                                    \
    z_ = z_ < 1.5f ? z_ : 1.5f;                                                                \
    uint32_t p_ = bits_of(z_) & 0x7f800000u;                                                   \
    uint32_t q = (p_ >> 23) & 7u;                                                              \
    float l_ = float_of(p_);                                                                   \
    float v = l_ >= 0.015625f ? l_ : 0.0f;
#define MAG_TABLE(y)                                                                           \
    uint32_t q = (uint32_t)((y) >= t0) + (uint32_t)((y) >= t1) + (uint32_t)((y) >= t2) +       \
                 (uint32_t)((y) >= t3) + (uint32_t)((y) >= t4) + (uint32_t)((y) >= t5) +       \
                 (uint32_t)((y) >= t6);                                                        \
    float v = l0;                                                                              \
    v = (y) >= t0 ? l1 : v; v = (y) >= t1 ? l2 : v; v = (y) >= t2 ? l3 : v;                   \
    v = (y) >= t3 ? l4 : v; v = (y) >= t4 ? l5 : v; v = (y) >= t5 ? l6 : v;                   \
    v = (y) >= t6 ? l7 : v;

/* the thresholds and levels as locals, so that the selects compile to blends */
#define LEVELS_LOCAL(L)                                                                        \
    const float t0 = (L)->thr[0], t1 = (L)->thr[1], t2 = (L)->thr[2], t3 = (L)->thr[3],        \
                t4 = (L)->thr[4], t5 = (L)->thr[5], t6 = (L)->thr[6];                          \
    const float l0 = (L)->lev[0], l1 = (L)->lev[1], l2 = (L)->lev[2], l3 = (L)->lev[3],        \
                l4 = (L)->lev[4], l5 = (L)->lev[5], l6 = (L)->lev[6], l7 = (L)->lev[7];        \
    (void)t0; (void)t1; (void)t2; (void)t3; (void)t4; (void)t5; (void)t6;                      \
    (void)l0; (void)l1; (void)l2; (void)l3; (void)l4; (void)l5; (void)l6; (void)l7

/* one value's contribution to a candidate's error */
#define ERR_TERM(MAG, a, inv, w, acc)                                                          \
    {                                                                                          \
        float y = (a) * (inv);                                                                 \
        MAG(y)                                                                                 \
        (void)q;                                                                               \
        int32_t di = (int32_t)(bits_of((y - v) * (w) + MAGIC) - 0x4b400000u);                  \
        acc += di * di;                                                                        \
    }

/* block_errors_F_N: N candidates' block errors (scales 1 / inv[c], weights w[c]) in one pass
 * (256 squares of at most 2^22 fit an int32); block_errors_F: one candidate */
#define FAMILY(NAME, MAG)                                                                      \
    INLINE int64_t block_error_##NAME(const float *x, int64_t m, float inv, float w,            \
                                      const levels4 *L) {                                     \
        LEVELS_LOCAL(L);                                                                       \
        const uint32_t *ux = (const uint32_t *)x;                                              \
        int64_t acc = 0;                                                                       \
        for (int64_t o = 0; o < m; o += 256) {                                                 \
            int64_t e = m - o < 256 ? m - o : 256;                                             \
            int32_t acc32 = 0;                                                                 \
            for (int64_t i = o; i < o + e; i++) {                                              \
                float a = float_of(ux[i] & 0x7fffffffu);                                       \
                ERR_TERM(MAG, a, inv, w, acc32)                                                \
            }                                                                                  \
            acc += acc32;                                                                      \
        }                                                                                      \
        return acc;                                                                            \
    }                                                                                          \
    INLINE void block_codes_##NAME(const float *x, int64_t m, float inv, const levels4 *L,     \
                                   uint8_t *c) {                                               \
        LEVELS_LOCAL(L);                                                                       \
        const uint32_t *ux = (const uint32_t *)x;                                              \
        for (int64_t i = 0; i < m; i++) {                                                      \
            float y = float_of(ux[i] & 0x7fffffffu) * inv;                                     \
            MAG(y)                                                                             \
            (void)v;                                                                           \
            c[i] = (uint8_t)(q | (((ux[i] >> 31) & ((0u - q) >> 31)) << 3));                   \
        }                                                                                      \
    }
#define FAMILY_N(NAME, MAG, N)                                                                 \
    INLINE void block_errors_##NAME##_##N(const float *x, int64_t m, const float *inv,         \
                                          const float *w, const levels4 *L, int64_t *err) {    \
        LEVELS_LOCAL(L);                                                                       \
        const uint32_t *ux = (const uint32_t *)x;                                              \
        for (int c = 0; c < N; c++) err[c] = 0;                                                \
        for (int64_t o = 0; o < m; o += 256) {                                                 \
            int64_t e = m - o < 256 ? m - o : 256;                                             \
            int32_t acc[N];                                                                    \
            for (int c = 0; c < N; c++) acc[c] = 0;                                            \
            for (int64_t i = o; i < o + e; i++) {                                              \
                float a = float_of(ux[i] & 0x7fffffffu);                                       \
                for (int c = 0; c < N; c++) ERR_TERM(MAG, a, inv[c], w[c], acc[c])             \
            }                                                                                  \
            for (int c = 0; c < N; c++) err[c] += acc[c];                                      \
        }                                                                                      \
    }

FAMILY(int4, MAG_INT4)
FAMILY(e2m1, MAG_E2M1)
FAMILY(e3m0, MAG_E3M0)
FAMILY(table, MAG_TABLE)
FAMILY_N(int4, MAG_INT4, 3)
FAMILY_N(e2m1, MAG_E2M1, 3)
FAMILY_N(table, MAG_TABLE, 3)
FAMILY_N(e3m0, MAG_E3M0, 8)

/* int4's offset-binary nibbles: clamp(round(x * inv), -7, 7) + 8, the same as rounding after the
 * clamp (+-7 are integers); clamped as integers, which vectorizes to min/max. |x * inv| stays
 * far below 2^22 (at most qn * 2^(hi/8)), where adding MAGIC rounds it. */
INLINE void block_codes_int4_ob(const float *x, int64_t m, float inv, uint8_t *c) {
    for (int64_t i = 0; i < m; i++) {
        int32_t r = (int32_t)(bits_of(x[i] * inv + MAGIC) - 0x4b400000u);
        r = r < 7 ? r : 7;
        r = r > -7 ? r : -7;
        c[i] = (uint8_t)(r + 8);
    }
}

/* the errors of nc candidates: one pass for the usual windows (a constant block of 32 unrolls) */
#define ERRORS_N(M)                                                                            \
    if (nc == 3 && fam == F_INT4) { block_errors_int4_3(x, M, inv, w, L, err); return; }       \
    if (nc == 3 && fam == F_E2M1) { block_errors_e2m1_3(x, M, inv, w, L, err); return; }       \
    if (nc == 3 && fam == F_TABLE) { block_errors_table_3(x, M, inv, w, L, err); return; }     \
    if (nc == 8 && fam == F_E3M0) { block_errors_e3m0_8(x, M, inv, w, L, err); return; }
INLINE void block_errors(int fam, const float *x, int64_t m, int nc, const float *inv,
                         const float *w, const levels4 *L, int64_t *err) {
    if (m == 32) { ERRORS_N(32) }
    ERRORS_N(m)
    for (int c = 0; c < nc; c++) {
        switch (fam) {
        case F_INT4: err[c] = block_error_int4(x, m, inv[c], w[c], L); break;
        case F_E2M1: err[c] = block_error_e2m1(x, m, inv[c], w[c], L); break;
        case F_E3M0: err[c] = block_error_e3m0(x, m, inv[c], w[c], L); break;
        default: err[c] = block_error_table(x, m, inv[c], w[c], L);
        }
    }
}

INLINE void block_codes(int fam, const float *x, int64_t m, float inv, const levels4 *L,
                        uint8_t *c) {
    switch (fam) {
    case F_INT4: block_codes_int4_ob(x, m, inv, c); break;
    case F_E2M1: block_codes_e2m1(x, m, inv, L, c); break;
    case F_E3M0: block_codes_e3m0(x, m, inv, L, c); break;
    default: block_codes_table(x, m, inv, L, c);
    }
}

/* the scale code for one block of m values: among k0 - lo .. k0 + hi (clamped to kmin .. 255),
 * the one with the least block error (the first on ties) */
INLINE int pick_scale(int fam, const float *xs, int64_t m, int k0, int lo, int hi, int kmin,
                      const float *su, const float *sinv, const levels4 *L) {
    int klo = k0 - lo < kmin ? kmin : k0 - lo, khi = k0 + hi > 255 ? 255 : k0 + hi;
    if (klo > khi) klo = khi = kmin; /* only with hi = 0 next to float max */
    int best = klo;
    if (khi > klo) {
        /* candidates k0 - lo .. k0 + hi, clamped into [klo, khi]: a repeated code has the same
         * error and never wins (the first minimum does) */
        int nc = lo + hi + 1, ks[MAXWIN];
        float inv[MAXWIN], w[MAXWIN];
        int64_t err[MAXWIN];
        float s = sinv[klo] * SEARCH_RES;
        for (int c = 0; c < nc; c++) {
            int k = k0 - lo + c;
            ks[c] = k < klo ? klo : k > khi ? khi : k;
            inv[c] = sinv[ks[c]];
            w[c] = su[ks[c]] * s;
        }
        block_errors(fam, xs, m, nc, inv, w, L, err);
        int64_t be = err[0];
        for (int c = 1; c < nc; c++) { /* branch-free: the winner is data-dependent */
            int64_t take = -(int64_t)(err[c] < be);
            be = (err[c] & take) | (be & ~take);
            best = (ks[c] & (int)take) | (best & ~(int)take);
        }
    }
    return best;
}

/* codes are staged in buf (blocks are contiguous: several per fill) and packed in pairs */
typedef struct {
    uint8_t buf[CHUNK4 + 2];
    int64_t len, start;
    uint8_t *out;
} pairer;

INLINE void pair_block(pairer *p, int fam, const float *xs, int64_t s0, int64_t m, float inv,
                       const levels4 *L) {
    for (int64_t o = 0; o < m;) {
        if (p->len == CHUNK4) {
            pack_pairs(p->buf, p->len, p->out + p->start / 2);
            p->len = 0;
        }
        if (p->len == 0) p->start = s0 + o;
        int64_t k = m - o < CHUNK4 - p->len ? m - o : CHUNK4 - p->len;
        block_codes(fam, xs + o, k, inv, L, p->buf + p->len);
        p->len += k;
        o += k;
    }
}

INLINE void pair_flush(pairer *p) {
    if (p->len % 2) p->buf[p->len++] = 0; /* odd count: the last byte's high nibble is 0 */
    if (p->len) pack_pairs(p->buf, p->len, p->out + p->start / 2);
}

CLONES static int encode4_blocks(int fam, const float *x, int64_t n, int64_t block, int64_t G,
                                 const levels4 *L, const float *U, float qn, int lo, int hi,
                                 float floor_, float *anchors, uint8_t *scodes,
                                 uint8_t *codes) {
    pairer pc;
    pc.len = pc.start = 0;
    pc.out = codes;
    const int search = lo + hi > 0;
    float am[256], su[256], sinv[256], reach[257];
    int k0s[256];
    int64_t nb = (n + block - 1) / block;
    const float top = L->lev[7];
    for (int64_t g0 = 0, gi = 0; g0 < nb; g0 += G, gi++) {
        int64_t g = nb - g0 < G ? nb - g0 : G;
        uint32_t mx = 0;
        for (int64_t j = 0; j < g; j++) {
            int64_t s0 = (g0 + j) * block, m = n - s0 < block ? n - s0 : block;
            uint32_t a = absmax_bits(x + s0, m);
            am[j] = float_of(a);
            mx = a > mx ? a : mx;
        }
        if (mx >= 0x7f800000u) return 1;
        float A = float_of(mx) < floor_ ? floor_ : float_of(mx);
        anchors[gi] = A;
        /* this group's 256 scales, their inverses and what k0 compares with (reach[256] < 0:
         * no absmax is below it) */
        for (int k = 0; k < 256; k++) su[k] = A * U[k];
        for (int k = 0; k < 256; k++) sinv[k] = 1.0f / su[k];
        for (int k = 0; k < 256; k++) reach[k] = su[k] * qn;
        reach[256] = -1.0f;
        /* kmin: the smallest code whose top level is finite (0 unless A is near float max) */
        int kmin = 0;
        while (!(su[kmin] * top <= 3.4028234663852886e38f)) kmin++;
        /* k0 = the largest k with am <= reach[k] (reach falls with k; k = 0 always holds).
         * reach[k] = A * 2^(2 - k/8) within rounding, so with am / A = 2^e * f (1 <= f < 2) and
         * o = #{i in 1..7: f >= 2^(i/8)}, k0 is 16 - 8e - o - 1 or 16 - 8e - o, give or take
         * one: start two below, step up while am <= reach[k + 1] (three times), and check the
         * result (a binary search where it fails: never, short of a rounding surprise) */
        int recheck = 0;
        for (int64_t j = 0; j < g; j++) {
            uint32_t b = bits_of(am[j] / A);
            int e = (int)(b >> 23) - 127;
            float f = float_of((b & 0x007fffffu) | 0x3f800000u);
            int o = (f >= 1.0905077326652577f) + (f >= 1.189207115002721f) +
                    (f >= 1.2968395546510096f) + (f >= 1.4142135623730951f) +
                    (f >= 1.5422108254079407f) + (f >= 1.681792830507429f) +
                    (f >= 1.8340080864093424f);
            int k = 14 - 8 * e - o;
            k = k < 0 ? 0 : k > 255 ? 255 : k;
            k += am[j] <= reach[k + 1];
            k += am[j] <= reach[k + 1];
            k += am[j] <= reach[k + 1];
            recheck |= !(am[j] <= reach[k]) | (am[j] <= reach[k + 1]);
            k0s[j] = k;
        }
        for (int64_t j = 0; recheck && j < g; j++) {
            int k = 0;
            for (int step = 128; step; step >>= 1) k += step & -(int)(am[j] <= reach[k + step]);
            k0s[j] = k;
        }
        for (int64_t j = 0; j < g; j++) {
            int64_t s0 = (g0 + j) * block, m = n - s0 < block ? n - s0 : block;
            const float *xs = x + s0;
            /* the default windows, (1, 1) and e3m0's (3, 4), with constants: their loops unroll */
            int best = lo == 1 && hi == 1   ? pick_scale(fam, xs, m, k0s[j], 1, 1, kmin, su, sinv, L)
                       : lo == 3 && hi == 4 ? pick_scale(fam, xs, m, k0s[j], 3, 4, kmin, su, sinv, L)
                                            : pick_scale(fam, xs, m, k0s[j], lo, hi, kmin, su, sinv, L);
            scodes[g0 + j] = (uint8_t)best;
            if (!search) pair_block(&pc, fam, xs, s0, m, sinv[best], L);
        }
        /* with a search, the codes in a second pass over the group (in cache): no block's codes
         * wait for its search, so the searches of consecutive blocks overlap */
        for (int64_t j = 0; search && j < g; j++) {
            int64_t s0 = (g0 + j) * block, m = n - s0 < block ? n - s0 : block;
            pair_block(&pc, fam, x + s0, s0, m, sinv[scodes[g0 + j]], L);
        }
    }
    pair_flush(&pc);
    return 0;
}

/* encode4(family, x, n, block, G, levels (15 floats: 7 thresholds, 8 levels), U, qn, lo, hi,
 *         floor, anchors, scodes, codes) -> 0 / 1 (non-finite input) */
static PyObject *encode4(PyObject *self, PyObject *args) {
    int fam, bad, lo, hi;
    unsigned long long px, pl, pu, pa, ps, pc;
    Py_ssize_t n, block, G;
    float qn, floor_;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKnnnKKfiifKKK", &fam, &px, &n, &block, &G, &pl, &pu, &qn, &lo,
                          &hi, &floor_, &pa, &ps, &pc))
        return NULL;
    if (fam < 0 || fam > 3 || G < 1 || G > 256 || block < 2 || lo < 0 || hi < 0 ||
        lo + hi >= MAXWIN) {
        PyErr_SetString(PyExc_ValueError, "encode4: bad family, block, group or window");
        return NULL;
    }
    levels4 L;
    memcpy(L.thr, (const float *)(uintptr_t)pl, sizeof L.thr);
    memcpy(L.lev, (const float *)(uintptr_t)pl + 7, sizeof L.lev);
    Py_BEGIN_ALLOW_THREADS
    bad = encode4_blocks(fam, (const float *)(uintptr_t)px, n, block, G, &L,
                         (const float *)(uintptr_t)pu, qn, lo, hi, floor_,
                         (float *)(uintptr_t)pa, (uint8_t *)(uintptr_t)ps,
                         (uint8_t *)(uintptr_t)pc);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(bad);
}

/* the scale of each block times the values already in out (m of them per block) */
INLINE void scale_blocks(float *o, int64_t nv, int64_t block, int64_t nb, float A,
                         const uint8_t *sc, const float *U) {
    for (int64_t j = 0; j < nb; j++) {
        float vs = A * U[sc[j]];
        int64_t s = j * block, m = nv - s < block ? nv - s : block;
        for (int64_t t = 0; t < m; t++) o[s + t] *= vs;
    }
}

/* per group: the values of all its nibbles in one pass (a 256-entry table of pairs), then each
 * block's values times its scale anchor * U[code] */
CLONES static void decode4s_blocks(const uint8_t *codes, int64_t n, int64_t block, int64_t G,
                                   const float *table, const float *anchors,
                                   const uint8_t *scodes, const float *U, float *out) {
    float pairs[256][2];
    for (int v = 0; v < 256; v++) {
        pairs[v][0] = table[v & 15];
        pairs[v][1] = table[v >> 4];
    }
    int64_t span = G * block;
    for (int64_t start = 0, g = 0; start < n; start += span, g++) {
        int64_t nv = n - start < span ? n - start : span, nb = (nv + block - 1) / block;
        float *o = out + start;
        const uint8_t *c = codes + start / 2; /* start is even: block is */
        for (int64_t i = 0; i < nv / 2; i++) memcpy(o + 2 * i, pairs[c[i]], 8);
        if (nv % 2) o[nv - 1] = pairs[c[nv / 2]][0]; /* odd count: the low nibble only */
        if (block == 32) /* the default: a constant trip count */
            scale_blocks(o, nv, 32, nb, anchors[g], scodes + g * G, U);
        else
            scale_blocks(o, nv, block, nb, anchors[g], scodes + g * G, U);
    }
}

/* decode4s(codes, n, block, G, table16, anchors, scodes, U, out) */
static PyObject *decode4s(PyObject *self, PyObject *args) {
    unsigned long long pc, pt, pa, ps, pu, po;
    Py_ssize_t n, block, G;
    if (!PyArg_ParseTuple(args, "KnnnKKKKK", &pc, &n, &block, &G, &pt, &pa, &ps, &pu, &po))
        return NULL;
    if (G < 1 || block < 1) {
        PyErr_SetString(PyExc_ValueError, "decode4s: bad block or group");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode4s_blocks((const uint8_t *)(uintptr_t)pc, n, block, G, (const float *)(uintptr_t)pt,
                    (const float *)(uintptr_t)pa, (const uint8_t *)(uintptr_t)ps,
                    (const float *)(uintptr_t)pu, (float *)(uintptr_t)po);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

CLONES static int has_nibble_bytes(const uint8_t *c, int64_t nbytes, uint8_t nib) {
    uint8_t acc = 0, hi = (uint8_t)(nib << 4);
    for (int64_t i = 0; i < nbytes; i++)
        acc |= (uint8_t)(((c[i] & 0x0f) == nib) | ((c[i] & 0xf0) == hi));
    return acc;
}

/* has_nibble(codes, nbytes, nib) -> bool: whether any nibble of the packed codes is nib */
static PyObject *has_nibble(PyObject *self, PyObject *args) {
    unsigned long long pc;
    Py_ssize_t nbytes;
    int r, nib;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kni", &pc, &nbytes, &nib)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    r = has_nibble_bytes((const uint8_t *)(uintptr_t)pc, nbytes, (uint8_t)(nib & 15));
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(r);
}

/* fingerprint32(x, n, start, k1, k2) -> the part of compress/fingerprint.py's sum that n uint32
 * words contribute at global word offsets start .. start + n - 1 of the stream: word g is in row
 * r = g / FP_ROW, column c = g % FP_ROW; a row's a_r = sum (x ^ k1[c]) * (x ^ k2[c]) (32 x 32 ->
 * 64-bit products) is weighted by (r * FP_W1 + FP_W2) | 1, all mod 2^64. The sum is linear in
 * a_r, so a row split between two calls adds up to the same value. */
#define FP_ROW 1024
#define FP_W1 0x9E3779B97F4A7C15ull
#define FP_W2 0x632BE59BD9B4E019ull
CLONES static uint64_t fingerprint_words(const uint32_t *x, int64_t n, int64_t start,
                                         const uint32_t *k1, const uint32_t *k2) {
    uint64_t f = 0;
    for (int64_t i = 0; i < n;) {
        int64_t g = start + i, r = g / FP_ROW, c0 = g % FP_ROW;
        int64_t m = n - i < FP_ROW - c0 ? n - i : FP_ROW - c0;
        const uint32_t *xr = x + i, *a1 = k1 + c0, *a2 = k2 + c0;
        uint64_t a = 0;
        for (int64_t c = 0; c < m; c++) a += (uint64_t)(xr[c] ^ a1[c]) * (uint64_t)(xr[c] ^ a2[c]);
        f += a * (((uint64_t)r * FP_W1 + FP_W2) | 1u);
        i += m;
    }
    return f;
}

static PyObject *fingerprint32(PyObject *self, PyObject *args) {
    unsigned long long px, pk1, pk2;
    Py_ssize_t n, start;
    uint64_t f;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnnKK", &px, &n, &start, &pk1, &pk2)) return NULL;
    if (n < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "fingerprint32: negative length or offset");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    f = fingerprint_words((const uint32_t *)(uintptr_t)px, n, start,
                          (const uint32_t *)(uintptr_t)pk1, (const uint32_t *)(uintptr_t)pk2);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(f);
}

/* One SGD step of n fp32 values, each product and sum rounded on its own (built with
 * -ffp-contract=off: no fused multiply-add), so the bits equal the torch path of
 * diloco/engine/streamed_outer.py:sgd_range element by element:
 *   v' = first ? u : mu*v + u;   g = nesterov ? mu*v' + u : v';   theta' = theta - lr*g
 * (mu == 0: theta' = theta - lr*u, no buffer). */
static void sgd_values(const float *theta, const float *buf, const float *u, float *theta_out, float *buf_out,
                       int64_t n, float lr, float mu, int nesterov) {
    for (int64_t i = 0; i < n; i++) {
        float g = u[i];
        if (mu != 0.0f) {
            float v = buf ? mu * buf[i] : 0.0f;
            v = buf ? v + u[i] : u[i];
            buf_out[i] = v;
            if (nesterov) {
                float t = mu * v;
                g = t + u[i];
            } else {
                g = v;
            }
        }
        float s = lr * g;
        theta_out[i] = theta[i] - s;
    }
}

static PyObject *sgd_step(PyObject *self, PyObject *args) {
    unsigned long long pt, pb, pu, pto, pbo;
    Py_ssize_t n;
    double lr, mu;
    int nesterov;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKKnddp", &pt, &pb, &pu, &pto, &pbo, &n, &lr, &mu, &nesterov)) return NULL;
    if (n < 0 || (mu != 0.0 && pbo == 0)) {
        PyErr_SetString(PyExc_ValueError, "sgd_step: negative length, or momentum without a buffer to write");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    sgd_values((const float *)(uintptr_t)pt, (const float *)(uintptr_t)pb, (const float *)(uintptr_t)pu,
               (float *)(uintptr_t)pto, (float *)(uintptr_t)pbo, n, (float)lr, (float)mu, nesterov);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Byte-transpose n words of w bytes (compress/entropy.py: shuffle): dst holds every word's byte 0,
 * then every byte 1, ...; unshuffle is its inverse. src and dst do not overlap. */
CLONES static void shuffle_words(const uint8_t *src, uint8_t *dst, int64_t n, int w) {
    if (w == 4) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t v;
            memcpy(&v, src + 4 * i, 4);
            dst[i] = (uint8_t)v;
            dst[n + i] = (uint8_t)(v >> 8);
            dst[2 * n + i] = (uint8_t)(v >> 16);
            dst[3 * n + i] = (uint8_t)(v >> 24);
        }
        return;
    }
    for (int64_t i = 0; i < n; i++)
        for (int k = 0; k < w; k++) dst[k * n + i] = src[i * w + k];
}

CLONES static void unshuffle_words(const uint8_t *src, uint8_t *dst, int64_t n, int w) {
    if (w == 4) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = (uint32_t)src[i] | (uint32_t)src[n + i] << 8 | (uint32_t)src[2 * n + i] << 16
                         | (uint32_t)src[3 * n + i] << 24;
            memcpy(dst + 4 * i, &v, 4);
        }
        return;
    }
    for (int64_t i = 0; i < n; i++)
        for (int k = 0; k < w; k++) dst[i * w + k] = src[k * n + i];
}

static PyObject *transpose_bytes(PyObject *args, int inverse) {
    unsigned long long ps, pd;
    Py_ssize_t n;
    int w;
    if (!PyArg_ParseTuple(args, "KKni", &ps, &pd, &n, &w)) return NULL;
    if (n < 0 || w < 1 || w > 8) {
        PyErr_SetString(PyExc_ValueError, "shuffle: negative word count or a width outside 1..8");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    (inverse ? unshuffle_words : shuffle_words)((const uint8_t *)(uintptr_t)ps, (uint8_t *)(uintptr_t)pd, n, w);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *shuffle(PyObject *self, PyObject *args) { (void)self; return transpose_bytes(args, 0); }
static PyObject *unshuffle(PyObject *self, PyObject *args) { (void)self; return transpose_bytes(args, 1); }

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS, "int8 blockwise encode: scales and codes (0 ok, 1 non-finite)"},
    {"decode8", decode8, METH_VARARGS, "int8 blockwise decode: codes x their block's scale"},
    {"encode4", encode4, METH_VARARGS, "4-bit layout-2 encode: anchors, scale codes, nibbles"},
    {"decode4s", decode4s, METH_VARARGS, "4-bit layout-2 decode: anchors x scale table x levels"},
    {"has_nibble", has_nibble, METH_VARARGS, "whether packed 4-bit codes hold a given nibble"},
    {"fingerprint32", fingerprint32, METH_VARARGS, "compress.fingerprint's sum over uint32 words"},
    {"shuffle", shuffle, METH_VARARGS, "byte-transpose words: all byte 0s, then all byte 1s, ..."},
    {"unshuffle", unshuffle, METH_VARARGS, "the inverse of shuffle"},
    {"sgd_step", sgd_step, METH_VARARGS, "one SGD step of fp32 values, products and sums rounded apart"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "compress._native", NULL, -1,
                                    methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
