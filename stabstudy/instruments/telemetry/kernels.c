/* Fused passes of stabstudy.telemetry.Monitor over float32 CPU tensors.
 *
 * Built by stabstudy/kernels.py (cc -O3 -fassociative-math ..., no -ffast-math: NaN and inf
 * must propagate into the sums, diverged runs are data). Each function walks the n tensors of
 * one optimizer step once, reading each element once, where separate torch ops would read each
 * array again per statistic. Sums run in float32 over blocks of BLOCK elements (vectorized) and
 * the block sums are added in double.
 *
 * Flat rows (gdst, gprev, wdst, wb, g) hold the n tensors back to back, in order.
 */
#include <stddef.h>
#include <stdint.h>

#define BLOCK 1024

static inline void grad_pass(const float *restrict g, int64_t len, float *restrict gdst,
                             const float *restrict gprev, const float *restrict w,
                             float *restrict wdst, double *restrict out, const int copy,
                             const int prev, const int weights)
{
    double sgg = 0.0, sgp = 0.0, sww = 0.0;
    for (int64_t s = 0; s < len; s += BLOCK) {
        const int64_t e = len - s < BLOCK ? len : s + BLOCK;
        float fgg = 0.0f, fgp = 0.0f, fww = 0.0f;
        for (int64_t i = s; i < e; i++) {
            const float x = g[i];
            fgg += x * x;
            if (copy)
                gdst[i] = x;
            if (prev)
                fgp += x * gprev[i];
            if (weights) {
                const float y = w[i];
                wdst[i] = y;
                fww += y * y;
            }
        }
        sgg += fgg;
        sgp += fgp;
        sww += fww;
    }
    out[0] = sgg;
    out[1] = sgp;
    out[2] = sww;
}

/* Per tensor t: out[3t] = g.g, out[3t+1] = g.gprev, out[3t+2] = w.w (0 where not asked);
 * out[3n..3n+2]: their sums over the tensors. gdst == NULL: norms only. w == NULL: also copy
 * the gradient into gdst (gprev unused). Otherwise copy the gradient into gdst and the weights
 * into wdst, and with gprev != NULL also sum g.gprev. */
void ss_grad(int64_t n, const float *const *g, const int64_t *len, float *gdst,
             const float *gprev, const float *const *w, float *wdst, double *out)
{
    int64_t off = 0;
    double tot[3] = {0.0, 0.0, 0.0};
    for (int64_t t = 0; t < n; t++) {
        double *o = out + 3 * t;
        if (gdst == NULL)
            grad_pass(g[t], len[t], NULL, NULL, NULL, NULL, o, 0, 0, 0);
        else if (w == NULL)
            grad_pass(g[t], len[t], gdst + off, NULL, NULL, NULL, o, 1, 0, 0);
        else if (gprev == NULL)
            grad_pass(g[t], len[t], gdst + off, NULL, w[t], wdst + off, o, 1, 0, 1);
        else
            grad_pass(g[t], len[t], gdst + off, gprev + off, w[t], wdst + off, o, 1, 1, 1);
        for (int k = 0; k < 3; k++)
            tot[k] += o[k];
        off += len[t];
    }
    for (int k = 0; k < 3; k++)
        out[3 * n + k] = tot[k];
}

/* wb holds the weights before the step. With w != NULL it becomes w_before - w_after (= -u);
 * with w == NULL it already holds -u. Per tensor t: out[2t] = u.u, out[2t+1] = (-u).g;
 * out[2n], out[2n+1]: their sums over the tensors. */
void ss_update(int64_t n, const float *const *w, const int64_t *len, float *wb,
               const float *g, double *out)
{
    int64_t off = 0;
    double tot_uu = 0.0, tot_ug = 0.0;
    for (int64_t t = 0; t < n; t++) {
        const float *restrict a = w ? w[t] : NULL;
        float *restrict d = wb + off;
        const float *restrict gg = g + off;
        const int64_t L = len[t];
        double suu = 0.0, sug = 0.0;
        for (int64_t s = 0; s < L; s += BLOCK) {
            const int64_t e = L - s < BLOCK ? L : s + BLOCK;
            float fuu = 0.0f, fug = 0.0f;
            if (a) {
                for (int64_t i = s; i < e; i++) {
                    const float u = d[i] - a[i];
                    d[i] = u;
                    fuu += u * u;
                    fug += u * gg[i];
                }
            } else {
                for (int64_t i = s; i < e; i++) {
                    const float u = d[i];
                    fuu += u * u;
                    fug += u * gg[i];
                }
            }
            suu += fuu;
            sug += fug;
        }
        out[2 * t] = suu;
        out[2 * t + 1] = sug;
        tot_uu += suu;
        tot_ug += sug;
        off += L;
    }
    out[2 * n] = tot_uu;
    out[2 * n + 1] = tot_ug;
}

/* Over all n tensors: out[0] = m.m, out[1] = sum(v), out[2] = #(v < thr). */
void ss_adam(int64_t n, const float *const *m, const float *const *v, const int64_t *len,
             float thr, double *out)
{
    double smm = 0.0, sv = 0.0, nb = 0.0;
    for (int64_t t = 0; t < n; t++) {
        const float *restrict a = m[t];
        const float *restrict b = v[t];
        const int64_t L = len[t];
        for (int64_t s = 0; s < L; s += BLOCK) {
            const int64_t e = L - s < BLOCK ? L : s + BLOCK;
            float fmm = 0.0f, fv = 0.0f, fb = 0.0f;
            for (int64_t i = s; i < e; i++) {
                const float x = a[i], y = b[i];
                fmm += x * x;
                fv += y;
                fb += y < thr ? 1.0f : 0.0f;
            }
            smm += fmm;
            sv += fv;
            nb += fb;
        }
    }
    out[0] = smm;
    out[1] = sv;
    out[2] = nb;
}
