/* CPU kernels for a decode step's rows, float32 (kimi_linear.ops.native; docs/kda.md §7, docs/model.md §1, §3,
 * §5).
 *
 * A CPU decode step of a small model is bound by per-op overhead, not arithmetic: every PyTorch op costs
 * 3-20 us there (more right after a projection has streamed a cold weight through the caches), and a KDA
 * layer's step between its two projections is ~65 of them, a MoE layer's ~57. Each function here is one call for
 * such a run of ops, the block calls for a decoder layer's whole attention half with its projections. Shapes and
 * formulas are those of the PyTorch path, which stays the reference.
 *
 * Compiled on first use by kimi_linear/ops/native/__init__.py (-O3 -march=native; sums may be reassociated and
 * vectorised; IEEE infinities and subnormals as usual: no -ffast-math, which would flush subnormals to zero in
 * the whole process).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
static inline int64_t thread_index(void) { return omp_get_thread_num(); }
static inline int64_t thread_count(void) { return omp_get_num_threads(); }
#else
static inline int64_t thread_index(void) { return 0; }
static inline int64_t thread_count(void) { return 1; }
#endif

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* torch.nn.functional.softplus with its default threshold: x above 20 is returned as is. */
static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static inline float sum_squares(const float *x, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

/* y = x / sqrt(mean(x^2) + eps) * w over n entries (F.rms_norm). x and y may be the same. */
static inline void rms_norm_row(const float *x, const float *w, float eps, int64_t n, float *y) {
    const float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* rms_norm over the last dim of rows x [rows, n] (row stride x_stride) into y [rows, n] (contiguous). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float eps, int64_t rows, int64_t n,
                  float *y) {
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * x_stride, w, eps, n, y + r * n);
}

/* The residual add and the next norm: s = x + delta, y = rms_norm(s) (ops.rms_norm.add_rms_norm); all rows
 * contiguous [rows, n]. s may be x. */
void add_rms_norm_f32(const float *x, const float *delta, const float *w, float eps, int64_t rows, int64_t n,
                      float *s, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++) s[r * n + i] = x[r * n + i] + delta[r * n + i];
        rms_norm_row(s + r * n, w, eps, n, y + r * n);
    }
}

/* kda_decode_f32's arguments (below), the same for every sequence. */
typedef struct {
    int64_t H, D, W;
    const float *qkv, *g_raw, *gate_raw, *beta_raw;
    int64_t qkv_stride, g_stride, gate_stride, beta_stride;
    const float *conv_w, *win_in, *S_in, *A_log, *dt_bias, *norm_w;
    float *win_out, *S_out, *out;
    int32_t has_lower_bound;
    float lower_bound, norm_eps, scale;
} KDAStep;

/* The causal depthwise conv over [window; x] and its SiLU for the n channels from c0 of sequence b (row `row`),
 * into y; then those channels of the window move on by one input. Reads before it writes, slot by slot in
 * increasing order, so the window may be updated in place (a serving pool). */
static void conv_channels(const KDAStep *p, int64_t b, int64_t row, int64_t c0, int64_t n, float *y)
{
    const int64_t W = p->W, C = 3 * p->H * p->D, win_size = (W - 1) * C;
    const float *x = p->qkv + b * p->qkv_stride + c0;
    const float *wi = p->win_in + row * win_size + c0;
    float *wo = p->win_out + row * win_size + c0;
    const float *cw = p->conv_w + c0;
    for (int64_t c = 0; c < n; c++) {
        float acc = x[c] * cw[(W - 1) * C + c];
        for (int64_t j = 0; j < W - 1; j++) acc += wi[j * C + c] * cw[j * C + c];
        y[c] = acc * sigmoidf(acc);
    }
    for (int64_t j = 0; j + 1 < W - 1; j++) memmove(wo + j * C, wi + (j + 1) * C, (size_t)n * sizeof(float));
    memcpy(wo + (W - 2) * C, x, (size_t)n * sizeof(float));
}

/* One head's step after the conv: q, k, v [D] its conv outputs; its gates, memory update and gated output norm. */
static void kda_head_step(const KDAStep *p, int64_t b, int64_t row, int64_t h, const float *q, const float *k,
                          const float *v)
{
    const int64_t H = p->H, D = p->D, HD = H * D;
    float kS[D], o[D], a[D], kn[D], qn[D];
    const float rq = p->scale / sqrtf(sum_squares(q, D) + 1e-6f);
    const float rk = 1.0f / sqrtf(sum_squares(k, D) + 1e-6f);
    for (int64_t i = 0; i < D; i++) { qn[i] = q[i] * rq; kn[i] = k[i] * rk; }
    const float rate = expf(p->A_log[h]);
    const float *gh = p->g_raw + b * p->g_stride + h * D, *bias = p->dt_bias + h * D;
    for (int64_t i = 0; i < D; i++) {
        const float gi = gh[i] + bias[i];
        a[i] = expf(p->has_lower_bound ? p->lower_bound * sigmoidf(rate * gi) : -rate * softplusf(gi));
    }
    const float beta = sigmoidf(p->beta_raw[b * p->beta_stride + h]);
    const float *Si = p->S_in + (row * H + h) * D * D;
    float *So = p->S_out + (row * H + h) * D * D;
    /* sweep 1: decay, and S^T k */
    for (int64_t j = 0; j < D; j++) kS[j] = 0.0f;
    for (int64_t i = 0; i < D; i++) {
        const float ai = a[i], ki = kn[i];
        for (int64_t j = 0; j < D; j++) {
            const float s = Si[i * D + j] * ai;
            So[i * D + j] = s;
            kS[j] += ki * s;
        }
    }
    /* sweep 2: the delta-rule write beta k (v - S^T k)^T, and o = S^T q */
    for (int64_t j = 0; j < D; j++) { kS[j] = v[j] - kS[j]; o[j] = 0.0f; }
    for (int64_t i = 0; i < D; i++) {
        const float bk = beta * kn[i], qi = qn[i];
        for (int64_t j = 0; j < D; j++) {
            const float s = So[i * D + j] + bk * kS[j];
            So[i * D + j] = s;
            o[j] += qi * s;
        }
    }
    /* gated output norm */
    const float *gate = p->gate_raw + b * p->gate_stride + h * D;
    float *oh = p->out + b * HD + h * D;
    rms_norm_row(o, p->norm_w, p->norm_eps, D, oh);
    for (int64_t j = 0; j < D; j++) oh[j] *= sigmoidf(gate[j]);
}

/* kda_decode_f32's work for heads h0 .. h1 of sequence b, in state row `row`: those heads' channels of the conv
 * (the q, k and v parts), then each head's step. */
static void kda_decode_heads(const KDAStep *p, int64_t b, int64_t row, int64_t h0, int64_t h1)
{
    const int64_t HD = p->H * p->D, n = (h1 - h0) * p->D;
    float y[3 * n];
    if (n == HD)        /* every head: the q, k and v parts are one run of channels */
        conv_channels(p, b, row, 0, 3 * n, y);
    else
        for (int64_t part = 0; part < 3; part++) conv_channels(p, b, row, part * HD + h0 * p->D, n, y + part * n);
    for (int64_t h = h0; h < h1; h++) {
        const int64_t o = (h - h0) * p->D;
        kda_head_step(p, b, row, h, y + o, y + n + o, y + 2 * n + o);
    }
}

/* Whether every rows[b] (b < B) names a row of a pool of n_rows; rows NULL: yes. */
static int rows_in_range(const int64_t *rows, int64_t B, int64_t n_rows) {
    for (int64_t b = 0; rows && b < B; b++)
        if (rows[b] < 0 || rows[b] >= n_rows) return 0;
    return 1;
}

/* One KDA decode token for B sequences: the short convolution, the gates, the delta-rule update and the gated
 * output norm of one layer (layers.kda.KimiDeltaAttention with use_qk_l2norm, beta sigmoid and the gate in
 * kernel, as the layer always runs the operator). H heads of size D (K = V = D), C = 3*H*D conv channels,
 * conv width W.
 *
 * qkv      [B, C] (row stride qkv_stride)   the projected q|k|v inputs of this token
 * g_raw    [B, H*D] (g_stride)              the forget gate's up-projection f_b(f_a(x))
 * gate_raw [B, H*D] (gate_stride)           the output gate's pre-activation
 * beta_raw [B, H] (beta_stride)             b_proj(x)
 * conv_w   [W, C]                           tap j multiplies the input W-1-j steps back
 * win_in / win_out   [., W-1, C]            the last W-1 inputs, oldest first
 * S_in / S_out       [., H, D, D]           the memory, key index first
 * rows     [B] or NULL                      the row of sequence b in the four state tensors of n_rows rows
 *                                           (NULL: row b); in and out may be the same (a serving pool, in place)
 * A_log [H], dt_bias [H*D]; lower_bound: used when has_lower_bound (K3's bounded gate)
 * norm_w [D], norm_eps: the gated output norm; scale: the query scale (D^-0.5)
 * out      [B, H*D]                         RMSNorm(o) * norm_w * sigmoid(gate), per head
 *
 * Per head, with q, k l2-normalised (eps 1e-6) and a_i = exp(log_decay_i):
 *   S <- diag(a) S;  S <- S + beta k (v - S^T k)^T;  o = scale * S^T q
 * computed in two sweeps over S (decay with S^T k, then the update with S^T q), each along contiguous rows.
 * Sequences, or with fewer sequences than `threads` their (sequence, head) pairs, are split between the threads
 * (distinct rows and heads: a serving pool's scratch row shared by padding rows is written by several, and never
 * read). Returns 0, or -1 (nothing written) when a row index is outside [0, n_rows).
 */
int32_t kda_decode_f32(
    int64_t B, int64_t H, int64_t D, int64_t W, int64_t n_rows,
    const float *qkv, int64_t qkv_stride,
    const float *g_raw, int64_t g_stride,
    const float *gate_raw, int64_t gate_stride,
    const float *beta_raw, int64_t beta_stride,
    const float *conv_w, const float *win_in, float *win_out,
    const float *S_in, float *S_out, const int64_t *rows,
    const float *A_log, const float *dt_bias, int32_t has_lower_bound, float lower_bound,
    const float *norm_w, float norm_eps, float scale,
    float *out, int32_t threads)
{
    if (!rows_in_range(rows, B, n_rows)) return -1;          /* before anything is written */
    const KDAStep p = {H, D, W, qkv, g_raw, gate_raw, beta_raw, qkv_stride, g_stride, gate_stride, beta_stride,
                       conv_w, win_in, S_in, A_log, dt_bias, norm_w, win_out, S_out, out, has_lower_bound,
                       lower_bound, norm_eps, scale};
    /* Work items: whole sequences when there are at least as many as threads, else (sequence, head) pairs, so
     * that one sequence's heads run side by side. A head's own conv pass costs: 16 sequences of 8 heads of 64
     * took 4-9% longer as (sequence, head) items than as sequences (2 threads), while one sequence ran 13-36%
     * faster as heads than on one core. */
    const int64_t G = B >= threads ? 1 : H;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (B * G > 1)
#endif
    for (int64_t i = 0; i < B * G; i++) {
        const int64_t b = i / G, g = i % G;
        kda_decode_heads(&p, b, rows ? rows[b] : b, g * H / G, (g + 1) * H / G);
    }
    return 0;
}

#ifdef _OPENMP
#define BARRIER _Pragma("omp barrier")
#else
#define BARRIER
#endif

/* Y[r, o] = sum_i M[o, i] X[row_r, i] for r < n and this thread's outputs o in [lo, hi); M [n_out, n_in] with
 * element (o, i) at M[o * so + i * si]; row_r = rows[r] (rows NULL: r), X rows ldx apart, Y rows ldy apart.
 * Each stretch of the weight is read once for all n rows (it stays in L1 while they use it): along contiguous
 * rows of M when si == 1, else (so == 1: stored transposed) along its contiguous columns. Both walk STREAMS rows
 * of the stored matrix side by side, because one sequential stream a thread leaves the memory system idle
 * between its prefetches: a [1672, 512] weight (the `small` preset's packed KDA projection) from DRAM on 2
 * threads, Intel box, us stored by rows / by columns: 105 / 140-150 one row at a time, 83-86 / 91-95 four at a
 * time, 78-80 / 87-89 eight; PyTorch's BLAS product of it in a decode step ~88. */
#define STREAMS 8
static void products(const float *M, int64_t so, int64_t si, const float *X, int64_t ldx, const int64_t *rows,
                     int64_t n, int64_t n_in, float *Y, int64_t ldy, int64_t lo, int64_t hi) {
    if (si == 1) {
        int64_t o = lo;
        for (; o + STREAMS <= hi; o += STREAMS) {
            const float *m = M + o * so;
            for (int64_t r = 0; r < n; r++) {
                const float *x = X + (rows ? rows[r] : r) * ldx;
                float acc[STREAMS] = {0.0f};
                for (int64_t i = 0; i < n_in; i++)
                    for (int64_t s = 0; s < STREAMS; s++) acc[s] += m[s * so + i] * x[i];
                for (int64_t s = 0; s < STREAMS; s++) Y[r * ldy + o + s] = acc[s];
            }
        }
        for (; o < hi; o++) {
            const float *m = M + o * so;
            for (int64_t r = 0; r < n; r++) {
                const float *x = X + (rows ? rows[r] : r) * ldx;
                float acc = 0.0f;
                for (int64_t i = 0; i < n_in; i++) acc += m[i] * x[i];
                Y[r * ldy + o] = acc;
            }
        }
    } else {
        for (int64_t r = 0; r < n; r++)
            for (int64_t o = lo; o < hi; o++) Y[r * ldy + o] = 0.0f;
        int64_t i = 0;
        for (; i + STREAMS <= n_in; i += STREAMS) {
            const float *m = M + i * si;
            for (int64_t r = 0; r < n; r++) {
                const float *x = X + (rows ? rows[r] : r) * ldx + i;
                float *y = Y + r * ldy;
                for (int64_t o = lo; o < hi; o++) {
                    float acc = y[o];
                    for (int64_t s = 0; s < STREAMS; s++) acc += m[s * si + o] * x[s];
                    y[o] = acc;
                }
            }
        }
        for (; i < n_in; i++) {
            const float *m = M + i * si;
            for (int64_t r = 0; r < n; r++) {
                const float xi = X[(rows ? rows[r] : r) * ldx + i];
                float *y = Y + r * ldy;
                for (int64_t o = lo; o < hi; o++) y[o] += m[o] * xi;
            }
        }
    }
}

/* `products` over all n_out outputs of M, this thread's share of them (threads split the outputs, so each streams
 * its own part of the weight). */
static void share_of_products(const float *M, int64_t so, int64_t si, const float *X, int64_t ldx, int64_t n,
                              int64_t n_in, int64_t n_out, float *Y, int64_t ldy, int64_t tid, int64_t nt) {
    products(M, so, si, X, ldx, NULL, n, n_in, Y, ldy, n_out * tid / nt, n_out * (tid + 1) / nt);
}

/* A block call's input h [B, Dm]: rms_norm(x) * in_norm_w, or x itself when in_norm_w is NULL. */
static void layer_input(const float *x, const float *in_norm_w, float in_eps, int64_t B, int64_t Dm, float *h) {
    if (in_norm_w)
        for (int64_t b = 0; b < B; b++) rms_norm_row(x + b * Dm, in_norm_w, in_eps, Dm, h + b * Dm);
    else
        memcpy(h, x, (size_t)(B * Dm) * sizeof(float));
}

/* A KDA decoder layer's attention half for B decode tokens, as one call (layers.kda.KimiDeltaAttention.
 * decode_block): the input norm, the packed input projection, the gates' up-projections, the step of
 * kda_decode_f32, the output projection, and the residual add with the next norm. Between the first norm and the
 * last add every product is split between the threads by output feature, in one parallel region.
 *
 * x [B, Dm]                      the residual stream; h = rms_norm(x) * in_norm_w (in_norm_w NULL: h = x)
 * P [n_pack, Dm] (P_so, P_si)    the packed projection: rows q|k|v (3HD), f_a (R), g_a (R, or HD when Gb is
 *                                NULL: the full-rank output gate itself), beta (H)
 * Fb, Gb [HD, R]                 the forget and output gates' up-projections (strides as in `products`)
 * conv_w ... scale               as in kda_decode_f32 (rows NULL: state row b; else rows[b] of n_rows)
 * Wo [Dm, HD] (Wo_so, Wo_si)     the output projection; delta = Wo o
 * post_norm_w NULL: out = delta; else out = x + delta and normed = rms_norm(out) * post_norm_w
 * Returns 0; -1 (nothing written) when a row index is outside [0, n_rows); -2 when the scratch cannot be had. */
int32_t kda_block_decode_f32(
    int64_t B, int64_t Dm, int64_t H, int64_t D, int64_t R, int64_t W, int64_t n_rows,
    const float *x, const float *in_norm_w, float in_eps,
    const float *P, int64_t P_so, int64_t P_si,
    const float *Fb, int64_t Fb_so, int64_t Fb_si, const float *Gb, int64_t Gb_so, int64_t Gb_si,
    const float *conv_w, const float *win_in, float *win_out, const float *S_in, float *S_out, const int64_t *rows,
    const float *A_log, const float *dt_bias, int32_t has_lower_bound, float lower_bound,
    const float *norm_w, float norm_eps, float scale,
    const float *Wo, int64_t Wo_so, int64_t Wo_si, const float *post_norm_w, float post_eps,
    float *out, float *normed, int32_t threads)
{
    if (!rows_in_range(rows, B, n_rows)) return -1;
    const int64_t HD = H * D, gate_w = Gb ? R : HD, n_pack = 3 * HD + R + gate_w + H;
    /* scratch rows: h [Dm], the projection [n_pack], g [HD], gate [HD], o [HD], delta [Dm] */
    const int64_t width = Dm + n_pack + 3 * HD + Dm;
    float *scratch = malloc((size_t)(B * width) * sizeof(float));
    if (!scratch) return -2;
    float *h = scratch, *proj = h + B * Dm, *g = proj + B * n_pack, *gate = g + B * HD, *o = gate + B * HD;
    float *delta = post_norm_w ? o + B * HD : out;
    layer_input(x, in_norm_w, in_eps, B, Dm, h);
    const KDAStep p = {H, D, W, proj, g, Gb ? gate : proj + 3 * HD + R, proj + 3 * HD + R + gate_w,
                       n_pack, HD, Gb ? HD : n_pack, n_pack,
                       conv_w, win_in, S_in, A_log, dt_bias, norm_w, win_out, S_out, o, has_lower_bound,
                       lower_bound, norm_eps, scale};
    const int64_t G = B >= threads ? 1 : H;     /* work items of the step, as in kda_decode_f32 */
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        const int64_t tid = thread_index(), nt = thread_count();
        share_of_products(P, P_so, P_si, h, Dm, B, Dm, n_pack, proj, n_pack, tid, nt);
        BARRIER
        share_of_products(Fb, Fb_so, Fb_si, proj + 3 * HD, n_pack, B, R, HD, g, HD, tid, nt);
        if (Gb) share_of_products(Gb, Gb_so, Gb_si, proj + 3 * HD + R, n_pack, B, R, HD, gate, HD, tid, nt);
        BARRIER
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < B * G; i++) {
            const int64_t b = i / G, k = i % G;
            kda_decode_heads(&p, b, rows ? rows[b] : b, k * H / G, (k + 1) * H / G);
        }
        /* (the worksharing loop ends in a barrier: every head's o is written) */
        share_of_products(Wo, Wo_so, Wo_si, o, HD, B, HD, Dm, delta, Dm, tid, nt);
    }
    if (post_norm_w)
        add_rms_norm_f32(x, delta, post_norm_w, post_eps, B, Dm, out, normed);
    free(scratch);
    return 0;
}

/* Entry j (E floats) of sequence b in an MLA cache: dense (block_table NULL), row b's entries from
 * cache + b * row_stride; paged, through the block table (mla_block_decode_f32's layouts). */
static inline const float *entry_at(const float *cache, int64_t E, int64_t b, int64_t j, int64_t row_stride,
                                    const int64_t *block_table, int64_t table_stride, int64_t block_size) {
    return block_table ? cache + (block_table[b * table_stride + j / block_size] * block_size + j % block_size) * E
                       : cache + b * row_stride + j * E;
}

/* An MLA decoder layer's attention half for B decode tokens, as one call (layers.mla.NoPEMLA.decode_block): the
 * input norm, the packed projection [q | latent | rope key], the new cache entry [rms_norm(latent) | rope key]
 * written into the cache, attention in latent space (docs/model.md §4: per head the absorbed query
 * [q_nope W_k | q_rope] against every entry, softmax, ctx = p [entries' latents], o = W_v ctx), o_proj, and the
 * residual add with the next norm. Products split between the threads by output feature; the attention by
 * (sequence, head).
 *
 * x [B, Dm]; P [H*(nope+R) + C + R, Dm] (P_so, P_si); kv_norm_w [C]; Wkv [H*(nope+v), C] kv_b_proj's weight
 * (Wkv_so, Wkv_si): W_k of head h its rows h(nope+v) .. +nope, W_v the v after them; Wo [Dm, H*v].
 * The cache, entries of C + R floats: dense (block_table NULL) row b's entries at cache + b*row_stride + j*(C+R),
 * lengths[0] entries each after this token's; paged, entry j of row b at pool row
 * block_table[b*table_stride + j/block_size]*block_size + j%block_size, lengths[b] of them; the new entry goes to
 * the last position (dense) or to pool row dst[b] (paged). in_norm_w / post_norm_w as in kda_block_decode_f32.
 * Returns 0, or -2 when the scratch cannot be had. */
int32_t mla_block_decode_f32(
    int64_t B, int64_t Dm, int64_t H, int64_t nope, int64_t R, int64_t v, int64_t C,
    const float *x, const float *in_norm_w, float in_eps,
    const float *P, int64_t P_so, int64_t P_si, const float *kv_norm_w, float kv_eps,
    const float *Wkv, int64_t Wkv_so, int64_t Wkv_si, float scale,
    float *cache, int64_t row_stride, const int64_t *block_table, int64_t table_stride, int64_t block_size,
    const int64_t *lengths, const int64_t *dst,
    const float *Wo, int64_t Wo_so, int64_t Wo_si, const float *post_norm_w, float post_eps,
    float *out, float *normed, int32_t threads)
{
    const int64_t E = C + R, qk = nope + R, n_pack = H * qk + E;
    int64_t L_max = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = lengths[block_table ? b : 0];
        L_max = L > L_max ? L : L_max;
    }
    /* scratch: h [B, Dm], the projection [B, n_pack], o [B, H v], delta [B, Dm]; per (row, head): absorbed query
     * [E], ctx [C], scores [L_max] */
    const int64_t per_row = Dm + n_pack + H * v + Dm, per_head = E + C + L_max;
    float *scratch = malloc((size_t)(B * per_row + B * H * per_head) * sizeof(float));
    if (!scratch) return -2;
    float *h = scratch, *proj = h + B * Dm, *o = proj + B * n_pack, *rows_delta = o + B * H * v;
    float *heads = rows_delta + B * Dm, *delta = post_norm_w ? rows_delta : out;
    layer_input(x, in_norm_w, in_eps, B, Dm, h);
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        const int64_t tid = thread_index(), nt = thread_count();
        share_of_products(P, P_so, P_si, h, Dm, B, Dm, n_pack, proj, n_pack, tid, nt);
        BARRIER
#ifdef _OPENMP
#pragma omp single
#endif
        for (int64_t b = 0; b < B; b++) {       /* the new entries: [rms_norm(latent) | rope key] */
            const int64_t L = lengths[block_table ? b : 0];
            float *e = block_table ? cache + dst[b] * E : cache + b * row_stride + (L - 1) * E;
            const float *kv = proj + b * n_pack + H * qk;
            rms_norm_row(kv, kv_norm_w, kv_eps, C, e);
            memcpy(e + C, kv + C, (size_t)R * sizeof(float));
        }
        /* (the single construct ends in a barrier: every entry is written) */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < B * H; i++) {
            const int64_t b = i / H, hd = i % H, L = lengths[block_table ? b : 0];
            float *qa = heads + i * per_head, *ctx = qa + E, *s = ctx + C;
            const float *q = proj + b * n_pack + hd * qk;
            /* absorbed query: qa[c] = sum_n q_nope[n] W_k[n, c] (W_k's element (n, c) as M's (c, n)), then q_rope */
            const float *Wk = Wkv + hd * (nope + v) * Wkv_so;
            products(Wk, Wkv_si, Wkv_so, q, nope, NULL, 1, nope, qa, C, 0, C);
            memcpy(qa + C, q + nope, (size_t)R * sizeof(float));
            float m = -INFINITY;
            for (int64_t j = 0; j < L; j++) {
                const float *e = entry_at(cache, E, b, j, row_stride, block_table, table_stride, block_size);
                float acc = 0.0f;
                for (int64_t c = 0; c < E; c++) acc += qa[c] * e[c];
                s[j] = acc * scale;
                m = s[j] > m ? s[j] : m;
            }
            float total = 0.0f;
            for (int64_t j = 0; j < L; j++) { s[j] = expf(s[j] - m); total += s[j]; }
            for (int64_t c = 0; c < C; c++) ctx[c] = 0.0f;
            for (int64_t j = 0; j < L; j++) {
                const float *e = entry_at(cache, E, b, j, row_stride, block_table, table_stride, block_size);
                const float pj = s[j] / total;
                for (int64_t c = 0; c < C; c++) ctx[c] += pj * e[c];
            }
            const float *Wv = Wkv + (hd * (nope + v) + nope) * Wkv_so;
            products(Wv, Wkv_so, Wkv_si, ctx, C, NULL, 1, C, o + b * H * v + hd * v, H * v, 0, v);
        }
        share_of_products(Wo, Wo_so, Wo_si, o, H * v, B, H * v, Dm, delta, Dm, tid, nt);
    }
    if (post_norm_w)
        add_rms_norm_f32(x, delta, post_norm_w, post_eps, B, Dm, out, normed);
    free(scratch);
    return 0;
}

/* The sigmoid router of a MoE layer for one token (layers.moe.SigmoidTopKRouter with one expert group):
 * s = sigmoid(router_w x); the top_k experts of s + bias, weighted by their s (renormalised to sum 1 when
 * renormalize, + 1e-20), times scaling. x [D], router_w [E, D] row-major, bias [E]; writes experts [top_k] int64
 * and weights [top_k], best first. */
static void router_topk(const float *x, const float *router_w, const float *bias, int64_t E, int64_t D,
                        int64_t top_k, int32_t renormalize, float scaling, int64_t *experts, float *weights) {
    float s[E], choice[E];
    for (int64_t e = 0; e < E; e++) {
        const float *w = router_w + e * D;
        float acc = 0.0f;
        for (int64_t i = 0; i < D; i++) acc += w[i] * x[i];
        s[e] = sigmoidf(acc);
        choice[e] = s[e] + bias[e];
    }
    float total = 0.0f;
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (choice[e] != -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
        choice[best] = -INFINITY;
        experts[j] = best;
        weights[j] = s[best];
        total += s[best];
    }
    const float norm = renormalize ? scaling / (total + 1e-20f) : scaling;
    for (int64_t j = 0; j < top_k; j++) weights[j] *= norm;
}

/* One GLU expert for the n rows x[rows[r]] ([D] each, ldx apart): out[rows[r]] += w[r] * W2 (silu(W1 x) * W3 x),
 * with W1 | W3 = M13 [2I, D] and W2 = M2 [D, I] (strides as in `products`), this thread's share of the features.
 * scratch: [n, 3I + D]. Called by every thread of a parallel region (it synchronises them). */
static void expert_rows(const float *M13, int64_t so13, int64_t si13, const float *M2, int64_t so2, int64_t si2,
                        int64_t D, int64_t I, const float *x, int64_t ldx, const int64_t *rows, const float *w,
                        int64_t n, float *scratch, float *out, int64_t tid, int64_t nt) {
    float *gu = scratch, *hidden = scratch + n * 2 * I, *y = hidden + n * I;
    int64_t lo = I * tid / nt, hi = I * (tid + 1) / nt;
    products(M13, so13, si13, x, ldx, rows, n, D, gu, 2 * I, lo, hi);                   /* gate rows */
    products(M13 + I * so13, so13, si13, x, ldx, rows, n, D, gu + I, 2 * I, lo, hi);    /* up rows */
    for (int64_t r = 0; r < n; r++)
        for (int64_t f = lo; f < hi; f++) {
            const float a = gu[r * 2 * I + f];
            hidden[r * I + f] = a * sigmoidf(a) * gu[r * 2 * I + I + f];
        }
    BARRIER
    lo = D * tid / nt, hi = D * (tid + 1) / nt;
    products(M2, so2, si2, hidden, I, NULL, n, I, y, D, lo, hi);
    for (int64_t r = 0; r < n; r++) {
        float *o = out + (rows ? rows[r] : r) * D;
        const float wr = w ? w[r] : 1.0f;
        for (int64_t f = lo; f < hi; f++) o[f] += wr * y[r * D + f];
    }
    BARRIER    /* the next expert reuses the scratch */
}

static void start_output(const float *residual, float *out, int64_t N, int64_t D) {
    for (int64_t i = 0; i < N * D; i++) out[i] = residual ? residual[i] : 0.0f;
}

/* A dense GLU MLP (layers.mlp.SwiGLUMLP) for N rows: out = residual + W2 (silu(W1 x) * W3 x); x, residual (or
 * NULL), out [N, D]; w13 [2I, D], w2 [D, I] with the strides of `products`; scratch [N, 3I + D]. */
void glu_rows_f32(const float *x, int64_t N, int64_t D, int64_t I, const float *w13, int64_t s13o, int64_t s13i,
                  const float *w2, int64_t s2o, int64_t s2i, const float *residual, float *out, float *scratch,
                  int32_t threads) {
    start_output(residual, out, N, D);
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    expert_rows(w13, s13o, s13i, w2, s2o, s2i, D, I, x, D, NULL, NULL, N, scratch, out, thread_index(),
                thread_count());
}

/* A MoE layer (layers.moe.SparseMoE: sigmoid router with one expert group, SiLU GLU experts stacked) for N rows:
 * out = residual + sum over each row's top_k experts of weight * expert(x) (+ the shared expert stacked at index
 * `shared` with weight 1 when shared >= 0). x, residual (or NULL), out [N, D]; router_w [E, D]; bias [E]; w13
 * [E', 2I, D] and w2 [E', D, I] at element strides (s13e, s13o, s13i) and (s2e, s2o, s2i); scratch [N, 3I + D].
 * Writes the choice into experts [N, top_k] and weights [N, top_k]. Experts run one after the other, each over
 * the rows that chose it (its weights read once for all of them), its products split between the threads by
 * output feature. Returns 0, or -1 when the working lists cannot be allocated (nothing written but the choice). */
int32_t moe_rows_f32(const float *x, int64_t N, int64_t D, int64_t I, const float *router_w, const float *bias,
                     int64_t E, int64_t top_k, int32_t renormalize, float scaling, int64_t shared,
                     const float *w13, int64_t s13e, int64_t s13o, int64_t s13i, const float *w2, int64_t s2e,
                     int64_t s2o, int64_t s2i, const float *residual, float *out, float *scratch,
                     int64_t *experts, float *weights, int32_t threads) {
    for (int64_t r = 0; r < N; r++)
        router_topk(x + r * D, router_w, bias, E, D, top_k, renormalize, scaling, experts + r * top_k,
                    weights + r * top_k);
    /* the rows of each expert, grouped by a counting sort over the (row, expert) pairs */
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t)), *rows = malloc((size_t)(N * top_k) * sizeof(int64_t));
    float *w = malloc((size_t)(N * top_k) * sizeof(float));
    if (!start || !rows || !w) { free(start); free(rows); free(w); return -1; }
    for (int64_t j = 0; j < N * top_k; j++) start[experts[j] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t fill[E];
    memcpy(fill, start, (size_t)E * sizeof(int64_t));
    for (int64_t j = 0; j < N * top_k; j++) {
        const int64_t at = fill[experts[j]]++;
        rows[at] = j / top_k;
        w[at] = weights[j];
    }
    start_output(residual, out, N, D);
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
        const int64_t tid = thread_index(), nt = thread_count();
        for (int64_t e = 0; e < E; e++)
            if (start[e + 1] > start[e])
                expert_rows(w13 + e * s13e, s13o, s13i, w2 + e * s2e, s2o, s2i, D, I, x, D, rows + start[e],
                            w + start[e], start[e + 1] - start[e], scratch, out, tid, nt);
        if (shared >= 0)
            expert_rows(w13 + shared * s13e, s13o, s13i, w2 + shared * s2e, s2o, s2i, D, I, x, D, NULL, NULL, N,
                        scratch, out, tid, nt);
    }
    free(start); free(rows); free(w);
    return 0;
}
