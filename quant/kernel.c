/* localllm's compiled quantizer: the block types without an importance matrix, byte-identical to
 * ggml's reference quantization (what `llama_model_quantize` runs for them).
 *
 * The numpy ports in kquants.py / legacy.py are the readable specification and the fallback where
 * no C compiler exists; this file does the same float32 operations in the same order, one block at
 * a time, so a tensor is quantized at C speed on threads that do not hold the GIL. Build flags
 * matter for exactness: -ffp-contract=off (ggml-base rounds `a*b + c` twice, no FMA) and no
 * -ffast-math. The build is in native.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK_K 256
#define EPS 1e-15f
#define MAXI(a, b) ((a) > (b) ? (a) : (b))
#define MINI(a, b) ((a) < (b) ? (a) : (b))

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 → IEEE half, round to nearest even (as F16C's vcvtps2ph and numpy's astype). */
static uint16_t to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = bits_of(f), shl1 = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = bits_of(base);
    const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
}

static float from_f16(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
    return float_of(sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized)));
}

static void put_f16(uint8_t *p, float f) { uint16_t h = to_f16(f); p[0] = h & 0xFF; p[1] = h >> 8; }
static float get_f16(const uint8_t *p) { return from_f16((uint16_t)(p[0] | (p[1] << 8))); }

/* round half to even for |v| < 2^22: add 1.5·2^23 and read the low bits */
static inline int nearest(float v) {
    float t = v + 12582912.f;
    int32_t i; memcpy(&i, &t, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* the value of largest magnitude (the first such), and that magnitude */
static float signed_max(int n, const float *x, float *amax) {
    float max = 0;
    *amax = 0;
    for (int i = 0; i < n; ++i) {
        const float ax = fabsf(x[i]);
        if (ax > *amax) { *amax = ax; max = x[i]; }
    }
    return max;
}

/* -- legacy blocks of 32 ------------------------------------------------------------------- */

/* Q4_0 (bits 4) and Q5_0 (bits 5): a scale from the value of largest magnitude */
static void qx_0(const float *x, uint8_t *y, int64_t nb, int bits) {
    const int size = bits == 4 ? 18 : 22, top = (1 << bits) - 1;
    const float half = (float)(1 << (bits - 1));  /* 8 or 16: levels 0..top stand for -half..half-1 */
    for (int64_t i = 0; i < nb; i++, x += 32, y += size) {
        float amax;
        const float max = signed_max(32, x, &amax);
        const float d = max / -half, id = d ? 1.0f / d : 0.0f;
        put_f16(y, d);
        uint32_t qh = 0;
        uint8_t *qs = y + (bits == 4 ? 2 : 6);
        for (int j = 0; j < 16; j++) {
            const uint8_t a = MINI(top, (int8_t)(x[j] * id + (half + 0.5f)));
            const uint8_t b = MINI(top, (int8_t)(x[j + 16] * id + (half + 0.5f)));
            qs[j] = (a & 0x0F) | ((b & 0x0F) << 4);
            qh |= ((a & 0x10u) >> 4) << j;
            qh |= ((b & 0x10u) >> 4) << (j + 16);
        }
        if (bits == 5) for (int k = 0; k < 4; k++) y[2 + k] = (qh >> (8 * k)) & 0xFF;
    }
}

/* Q4_1 (bits 4) and Q5_1 (bits 5): a scale and the minimum */
static void qx_1(const float *x, uint8_t *y, int64_t nb, int bits) {
    const int size = bits == 4 ? 20 : 24;
    for (int64_t i = 0; i < nb; i++, x += 32, y += size) {
        float min = 3.402823466e+38f, max = -3.402823466e+38f;
        for (int j = 0; j < 32; j++) { if (x[j] < min) min = x[j]; if (x[j] > max) max = x[j]; }
        const float d = (max - min) / ((1 << bits) - 1), id = d ? 1.0f / d : 0.0f;
        put_f16(y, d);
        put_f16(y + 2, min);
        uint32_t qh = 0;
        uint8_t *qs = y + (bits == 4 ? 4 : 8);
        for (int j = 0; j < 16; j++) {
            const float v0 = (x[j] - min) * id + 0.5f, v1 = (x[j + 16] - min) * id + 0.5f;
            /* as the reference: Q4_1 clamps an int8 cast to 15, Q5_1 casts to uint8 */
            const uint8_t a = bits == 4 ? MINI(15, (int8_t)v0) : (uint8_t)v0;
            const uint8_t b = bits == 4 ? MINI(15, (int8_t)v1) : (uint8_t)v1;
            qs[j] = (a & 0x0F) | ((b & 0x0F) << 4);
            qh |= ((a & 0x10u) >> 4) << j;
            qh |= ((b & 0x10u) >> 4) << (j + 16);
        }
        if (bits == 5) for (int k = 0; k < 4; k++) y[4 + k] = (qh >> (8 * k)) & 0xFF;
    }
}

static void q8_0(const float *x, uint8_t *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32, y += 34) {
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = MAXI(amax, fabsf(x[j]));
        const float d = amax / 127, id = d ? 1.0f / d : 0.0f;
        put_f16(y, d);
        for (int j = 0; j < 32; j++) y[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
    }
}

/* -- K-quants: super-blocks of 256 --------------------------------------------------------- */

/* the scale and minimum of one group: the weighted search over nstep+1 scales (squared errors, or
 * absolute ones with use_mad) */
static float qkx2(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min,
                  float rmin, float rdelta, int nstep, int use_mad) {
    uint8_t aux[32];
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, n);
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; ++i) {
        const int l = nearest(iscale * (x[i] - min));
        L[i] = MAXI(0, MINI(nmax, l));
        const float diff = scale * L[i] + min - x[i];
        best += w[i] * (use_mad ? fabsf(diff) : diff * diff);
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest(iscale * (x[i] - min));
            l = MAXI(0, MINI(nmax, l));
            aux[i] = l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float err = 0;
            for (int i = 0; i < n; ++i) {
                const float diff = this_scale * aux[i] + this_min - x[i];
                err += w[i] * (use_mad ? fabsf(diff) : diff * diff);
            }
            if (err < best) {
                memcpy(L, aux, n);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* levels round(iscale·x) in [-nmax, nmax) (stored + offset in L, unless L is NULL) and the sums
 * Σw·x·l, Σw·l² with weights w = x² */
static void symmetric(int n, int nmax, float iscale, const float *x, int8_t *L, int offset, float *sumlx,
                      float *suml2) {
    float slx = 0, sl2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest(iscale * x[i]);
        l = MAXI(-nmax, MINI(nmax - 1, l));
        if (L) L[i] = l + offset;
        const float w = x[i] * x[i];
        slx += w * x[i] * l;
        sl2 += w * l * l;
    }
    *sumlx = slx;
    *suml2 = sl2;
}

/* Q6_K's symmetric scale of 16 values (rmse_type 1: weights x²), L in [0, 2·nmax) */
static float qx(int n, int nmax, const float *x, int8_t *L) {
    float amax;
    const float max = signed_max(n, x, &amax);
    if (amax < EPS) {
        memset(L, 0, n);
        return 0.f;
    }
    float iscale = -nmax / max, sumlx, suml2;
    symmetric(n, nmax, iscale, x, L, nmax, &sumlx, &suml2);
    float scale = suml2 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        symmetric(n, nmax, iscale, x, NULL, 0, &sumlx, &suml2);
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) {
                const int l = nearest(iscale * x[i]);
                L[i] = nmax + MAXI(-nmax, MINI(nmax - 1, l));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's symmetric scale of 16 values with five rounds of coordinate descent; L in [0, 2·nmax) */
static float q3(int n, int nmax, const float *x, int8_t *L) {
    float amax;
    const float max = signed_max(n, x, &amax);
    if (amax < EPS) {
        memset(L, 0, n);
        return 0.f;
    }
    float sumlx, suml2;
    symmetric(n, nmax, -nmax / max, x, L, 0, &sumlx, &suml2);
    for (int itry = 0; itry < 5; ++itry) {
        int changed = 0;
        for (int i = 0; i < n; ++i) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int l = nearest(x[i] * sl2 / slx);
                l = MAXI(-nmax, MINI(nmax - 1, l));
                if (l != L[i]) {
                    slx += w * x[i] * l;
                    sl2 += w * l * l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++changed;
                    }
                }
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; ++i) L[i] += nmax;
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* the 2-bit levels of 256 values, four to a byte, as Q2_K and Q3_K store them */
static void pack2(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; ++l)
            qs[j / 4 + l] = L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6);
}

static void q2_k(const float *x, uint8_t *y, int64_t nb) {
    uint8_t L[QK_K];
    float w[16], mins[16], scales[16];
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += 84) {
        uint8_t *sc = y, *qs = y + 16;
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; ++j) {
            for (int l = 0; l < 16; ++l) w[l] = fabsf(x[16 * j + l]);
            scales[j] = qkx2(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, 1);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            const float iscale = 15.f / max_scale;
            for (int j = 0; j < 16; ++j) sc[j] = (uint8_t)nearest(iscale * scales[j]);
            put_f16(y + 80, max_scale / 15.f);
        } else {
            memset(sc, 0, 16);
            put_f16(y + 80, 0.f);
        }
        if (max_min > 0) {
            const float iscale = 15.f / max_min;
            for (int j = 0; j < 16; ++j) sc[j] |= (uint8_t)(nearest(iscale * mins[j]) << 4);
            put_f16(y + 82, max_min / 15.f);
        } else {
            put_f16(y + 82, 0.f);
        }
        for (int j = 0; j < 16; ++j) {
            const float d = get_f16(y + 80) * (sc[j] & 0xF);
            if (!d) continue;
            const float dm = get_f16(y + 82) * (sc[j] >> 4);
            for (int ii = 0; ii < 16; ++ii) {
                const int l = nearest((x[16 * j + ii] + dm) / d);
                L[16 * j + ii] = MAXI(0, MINI(3, l));
            }
        }
        pack2(L, qs);
    }
}

static void q3_k(const float *x, uint8_t *y, int64_t nb) {
    int8_t L[QK_K];
    float scales[16];
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += 110) {
        uint8_t *hmask = y, *qs = y + 32, *sc = y + 96;
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; ++j) {
            scales[j] = q3(16, 4, x + 16 * j, L + 16 * j);
            if (fabsf(scales[j]) > amax) {
                amax = fabsf(scales[j]);
                max_scale = scales[j];
            }
        }
        memset(sc, 0, 12);
        if (max_scale) {
            const float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; ++j) {
                int8_t l = nearest(iscale * scales[j]);
                l = MAXI(-32, MINI(31, l)) + 32;
                if (j < 8) sc[j] = l & 0xF;
                else sc[j - 8] |= ((l & 0xF) << 4);
                l >>= 4;
                sc[j % 4 + 8] |= (l << (2 * (j / 4)));
            }
            put_f16(y + 108, 1 / iscale);
        } else {
            put_f16(y + 108, 0.f);
        }
        for (int j = 0; j < 16; ++j) {
            int8_t s = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4;
            s = (s | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
            const float d = get_f16(y + 108) * s;
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                const int l = nearest(x[16 * j + ii] / d);
                L[16 * j + ii] = MAXI(-4, MINI(3, l)) + 4;
            }
        }
        memset(hmask, 0, 32);
        int m = 0;
        uint8_t hm = 1;
        for (int j = 0; j < QK_K; ++j) {
            if (L[j] > 3) {
                hmask[m] |= hm;
                L[j] -= 4;
            }
            if (++m == QK_K / 8) {
                m = 0;
                hm <<= 1;
            }
        }
        pack2((const uint8_t *)L, qs);
    }
}

static void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/* Q4_K (nmax 15) and Q5_K (nmax 31): eight groups of 32, 6-bit scales and minimums */
static void qk_45(const float *x, uint8_t *y, int64_t nb, int nmax) {
    const int size = nmax == 15 ? 144 : 176;
    uint8_t L[QK_K];
    float mins[8], scales[8], w[32];
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += size) {
        uint8_t *sc = y + 4;
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 8; ++j) {
            float sum_x2 = 0;
            for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
            const float av_x = sqrtf(sum_x2 / 32);
            for (int l = 0; l < 32; ++l) w[l] = av_x + fabsf(x[32 * j + l]);
            scales[j] = nmax == 15 ? qkx2(32, 15, x + 32 * j, w, L + 32 * j, &mins[j], -1.f, 0.1f, 20, 0)
                                   : qkx2(32, 31, x + 32 * j, w, L + 32 * j, &mins[j], -0.5f, 0.1f, 15, 0);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
        const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        memset(sc, 0, 12);
        for (int j = 0; j < 8; ++j) {
            uint8_t ls = nearest(inv_scale * scales[j]), lm = nearest(inv_min * mins[j]);
            ls = MINI(63, ls);
            lm = MINI(63, lm);
            if (j < 4) {
                sc[j] = ls;
                sc[j + 4] = lm;
            } else {
                sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                sc[j - 4] |= ((ls >> 4) << 6);
                sc[j - 0] |= ((lm >> 4) << 6);
            }
        }
        put_f16(y, max_scale / 63.f);
        put_f16(y + 2, max_min / 63.f);
        for (int j = 0; j < 8; ++j) {
            uint8_t s, m;
            scale_min_k4(j, sc, &s, &m);
            const float d = get_f16(y) * s;
            if (!d) continue;
            const float dm = get_f16(y + 2) * m;
            for (int ii = 0; ii < 32; ++ii) {
                const int l = nearest((x[32 * j + ii] + dm) / d);
                L[32 * j + ii] = MAXI(0, MINI(nmax, l));
            }
        }
        if (nmax == 15) {
            uint8_t *q = y + 16;
            for (int j = 0; j < QK_K; j += 64, q += 32)
                for (int l = 0; l < 32; ++l) q[l] = L[j + l] | (L[j + l + 32] << 4);
        } else {
            uint8_t *qh = y + 16, *ql = y + 48, m1 = 1, m2 = 2;
            memset(qh, 0, 32);
            for (int n = 0; n < QK_K; n += 64, ql += 32, m1 <<= 2, m2 <<= 2) {
                for (int j = 0; j < 32; ++j) {
                    int l1 = L[n + j], l2 = L[n + j + 32];
                    if (l1 > 15) { l1 -= 16; qh[j] |= m1; }
                    if (l2 > 15) { l2 -= 16; qh[j] |= m2; }
                    ql[j] = l1 | (l2 << 4);
                }
            }
        }
    }
}

static void q6_k(const float *x, uint8_t *y, int64_t nb) {
    int8_t L[QK_K];
    float scales[16];
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += 210) {
        uint8_t *ql = y, *qh = y + 128;
        int8_t *sc = (int8_t *)(y + 192);
        float max_scale = 0, max_abs = 0;
        for (int ib = 0; ib < 16; ++ib) {
            scales[ib] = qx(16, 32, x + 16 * ib, L + 16 * ib);
            if (fabsf(scales[ib]) > max_abs) {
                max_abs = fabsf(scales[ib]);
                max_scale = scales[ib];
            }
        }
        if (max_abs < EPS) {
            memset(y, 0, 210);
            put_f16(y + 208, 0.f);
            continue;
        }
        const float iscale = -128.f / max_scale;
        put_f16(y + 208, 1 / iscale);
        for (int ib = 0; ib < 16; ++ib) sc[ib] = MINI(127, nearest(iscale * scales[ib]));
        for (int j = 0; j < 16; ++j) {
            const float d = get_f16(y + 208) * sc[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                const int l = nearest(x[16 * j + ii] / d);
                L[16 * j + ii] = MAXI(-32, MINI(31, l)) + 32;
            }
        }
        for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; ++l) {
                const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF;
                const uint8_t q3 = L[j + l + 64] & 0xF, q4 = L[j + l + 96] & 0xF;
                ql[l] = q1 | (q3 << 4);
                ql[l + 32] = q2 | (q4 << 4);
                qh[l] = (L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                        ((L[j + l + 96] >> 4) << 6);
            }
        }
    }
}

/* bfloat16, round to nearest even; a NaN stays a (quiet) NaN, as ggml's GGML_FP32_TO_BF16 */
static void bf16(const float *x, uint8_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++, y += 2) {
        const uint32_t u = bits_of(x[i]);
        const uint16_t h = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 64)
                                                           : (uint16_t)((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
        y[0] = h & 0xFF;
        y[1] = h >> 8;
    }
}

static void f16(const float *x, uint8_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++, y += 2) put_f16(y, x[i]);
}

/* -- IQ4_NL (blocks of 32) and IQ4_XS (super-blocks of 256): a non-uniform table of 16 levels ---- */

static const int8_t IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* the index of the table value nearest to v (the lower one on a tie) */
static inline int iq4_index(float v) {
    if (v <= IQ4[0]) return 0;
    if (v >= IQ4[15]) return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (v < IQ4[mid]) hi = mid; else lo = mid;
    }
    return v - IQ4[hi - 1] < IQ4[hi] - v ? hi - 1 : hi;
}

/* One super-block of `super` values in groups of 32: each group's scale by a search over 15 table
 * offsets (weights x², or qw·sqrt(σ² + x²) with an importance matrix); IQ4_XS then codes the
 * scales in 6 bits under one f16. y: d, [scales_h (2), scales_l (4)], qs. */
static void iq4_block(int super, const float *x, uint8_t *y, const float *qw) {
    uint8_t L[QK_K];
    float scales[QK_K / 32], w[32];
    const int nb = super / 32, ntry = 7;
    uint8_t *qs = y + (super == 32 ? 2 : 8);
    float sigma2 = 0;
    for (int j = 0; j < super; ++j) sigma2 += x[j] * x[j];
    sigma2 *= 2.f / super;
    memset(qs, 0, super / 2);
    float max_scale = 0, amax_scale = 0;
    for (int ib = 0; ib < nb; ++ib) {
        const float *xb = x + 32 * ib;
        uint8_t *Lb = L + 32 * ib;
        for (int j = 0; j < 32; ++j) w[j] = qw ? qw[32 * ib + j] * sqrtf(sigma2 + xb[j] * xb[j]) : xb[j] * xb[j];
        float amax;
        const float max = signed_max(32, xb, &amax);
        if (amax < EPS) {
            scales[ib] = 0;
            continue;
        }
        float d = -max / IQ4[0], id = 1 / d, sumqx = 0, sumq2 = 0;
        for (int j = 0; j < 32; ++j) {
            const int l = iq4_index(id * xb[j]);
            Lb[j] = l;
            const float q = IQ4[l];
            sumqx += w[j] * q * xb[j];
            sumq2 += w[j] * q * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
        float best = d * sumqx;
        for (int itry = -ntry; itry <= ntry; ++itry) {
            id = (itry + IQ4[0]) / max;
            sumqx = sumq2 = 0;
            for (int j = 0; j < 32; ++j) {
                const float q = IQ4[iq4_index(id * xb[j])];
                sumqx += w[j] * q * xb[j];
                sumq2 += w[j] * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        if (fabsf(d) > amax_scale) {
            amax_scale = fabsf(d);
            max_scale = d;
        }
    }
    if (nb > 1) {
        uint16_t scales_h = 0;
        uint8_t *scales_l = y + 4;
        const float d = -max_scale / 32, id = d ? 1 / d : 0.f;
        put_f16(y, d);
        for (int ib = 0; ib < nb; ++ib) {
            int l = nearest(id * scales[ib]);
            l = MAXI(-32, MINI(31, l));
            const float dl = d * l, idl = dl ? 1 / dl : 0.f;
            for (int j = 0; j < 32; ++j) L[32 * ib + j] = iq4_index(idl * x[32 * ib + j]);
            l += 32;
            if (ib % 2 == 0) scales_l[ib / 2] = l & 0xf;
            else scales_l[ib / 2] |= (l & 0xf) << 4;
            scales_h |= (uint16_t)((l >> 4) << 2 * (ib % 8));
        }
        y[2] = scales_h & 0xFF;
        y[3] = scales_h >> 8;
    } else {
        put_f16(y, scales[0]);
        const float id = scales[0] ? 1 / scales[0] : 0;
        for (int j = 0; j < super; ++j) L[j] = iq4_index(id * x[j]);
    }
    for (int i = 0; i < super / 32; ++i)
        for (int j = 0; j < 16; ++j) qs[16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4);
}

/* `type` (below) of `n` float32 values, whole blocks, into y; 0, or -1 for a type this file lacks */
static int quantize_values(int type, const float *x, uint8_t *y, int64_t n) {
    switch (type) {
        case 0: qx_0(x, y, n / 32, 4); return 0;
        case 1: qx_1(x, y, n / 32, 4); return 0;
        case 2: qx_0(x, y, n / 32, 5); return 0;
        case 3: qx_1(x, y, n / 32, 5); return 0;
        case 4: q8_0(x, y, n / 32); return 0;
        case 5: qk_45(x, y, n / QK_K, 15); return 0;
        case 6: qk_45(x, y, n / QK_K, 31); return 0;
        case 7: q6_k(x, y, n / QK_K); return 0;
        case 8: bf16(x, y, n); return 0;
        case 9: q2_k(x, y, n / QK_K); return 0;
        case 10: q3_k(x, y, n / QK_K); return 0;
        case 11: f16(x, y, n); return 0;
        default: return -1;
    }
}

/* The entry point: `rows` rows of `n` float32 values of `type` into y, row after row. `qw`: the
 * importance of each of the n columns (llama.cpp's quant_weights), or NULL; only the IQ4 types
 * take one here. Returns 0, or -1 for a type (or a type with importance) this file does not have.
 * Types: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0, 5 Q4_K, 6 Q5_K, 7 Q6_K, 8 BF16, 9 Q2_K, 10 Q3_K,
 * 11 F16, 12 IQ4_NL, 13 IQ4_XS. */
int localllm_quantize(int type, const float *x, uint8_t *y, int64_t rows, int64_t n, const float *qw) {
    if (type == 12 || type == 13) {
        const int super = type == 12 ? 32 : QK_K, size = type == 12 ? 18 : 136;
        for (int64_t r = 0; r < rows; r++, x += n)
            for (int64_t b = 0; b < n / super; b++, y += size) iq4_block(super, x + super * b, y, qw ? qw + super * b : NULL);
        return 0;
    }
    if (qw) return -1;
    return quantize_values(type, x, y, rows * n);
}
