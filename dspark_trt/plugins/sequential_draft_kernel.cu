// SequentialDraft as one CUDA kernel: the ahead-of-time implementation of the TensorRT plugin
// (`sequential_draft_trt.py` hands its PTX to `tensorrt.plugin.aot_impl`, so an engine holding the
// plugin runs without Python: trtexec, Triton's TensorRT backend, TensorRT-LLM's C++ runtime).
//
// Semantics: `sequential_draft.py`'s module docstring, slot by slot, row by row. One thread block
// drafts one row b of the batch; the block's threads share each slot's vocabulary-wide work
// (bias, copy bias, softmax, argmax, the inverse CDF) and one thread does the short serial parts
// (the copy n-gram lookup, the GRU state). The distributions output doubles as the slot's scratch
// row: the logits are built there, then replaced by the probabilities.
//
// One source, two compilers: nvcc builds it to PTX for TensorRT; with DSPARK_HOST the host C++
// compiler builds the same row routine into a library (one "thread" per block) that
// tests/test_plugin_kernel.py runs against the torch reference on CPU.
//
// Kernel arguments, in TensorRT's AOT order (inputs, extra int32 scalars, outputs):
//   logits [B,G,V] f32, hidden [B,G,D] f32, anchor_ids [B] i64, w1 [V+1,R] f32, w2 [R,V] f32,
//   gru_w_ih [3R,R+D], gru_w_hh [3R,R], gru_b_ih [3R], gru_b_hh [3R] f32 (placeholders unless RNN),
//   conf_w [D+R], conf_b [1], conf_inv_temps [G], temperatures [B], uniforms [B,G] f32,
//   history [B,H] i64, draft_vocab [V] i64, to_draft [V_target] i64, copy_alpha [G,N],
//   copy_beta [G,N], top_prob_w [G] f32;
//   B, G, V, D, R, H, N, V_target, head, has_confidence, copy_ngram, copy_confidence, top_prob;
//   draft_ids [B,G] i64, token_probs [B,G] f32, confidences [B,G] f32, distributions [B,G,V] f32.

#include <math.h>
#include <stdint.h>

#ifdef DSPARK_HOST
#define DEVICE static inline
#define SYNC()
#else
#define DEVICE __device__ __forceinline__
#define SYNC() __syncthreads()
#endif

#define HEAD_NONE 0
#define HEAD_MARKOV 1
#define HEAD_RNN 2
#define NO_CANDIDATE (-1)
#define MAX_NGRAM 8
#define TOP_PROBABILITY_LOGIT_CAP 13.815509557963773f

struct Args {
    const float *logits, *hidden;
    const int64_t *anchor_ids;
    const float *w1, *w2, *gru_w_ih, *gru_w_hh, *gru_b_ih, *gru_b_hh, *conf_w, *conf_b, *conf_inv_temps,
        *temperatures, *uniforms;
    const int64_t *history, *draft_vocab, *to_draft;
    const float *copy_alpha, *copy_beta, *top_prob_w;
    int B, G, V, D, R, H, N, V_target, head, has_confidence, copy_ngram, copy_confidence, top_prob;
    int64_t *draft_ids;
    float *token_probs, *confidences, *distributions;
};

// Work shared by the block's threads: per-thread partials for the reductions, then the row state.
struct Shared {
    float *partial;      // [threads]
    int *partial_index;  // [threads]
    float *state;        // [R]  the RNN state s_k
    float *previous;     // [R]  W1[x_{k-1}]
    float *gates;        // [6R] the GRU's input and hidden gate pre-activations
    int *candidates;     // [MAX_NGRAM] draft-vocabulary copy candidates of the slot
    float *scalars;      // [2] a reduction's result
    int *ids;            // [2] token ids chosen by thread 0 (ints: exact for any vocabulary)
};

DEVICE float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// The target id at position t of the row's sequence: the history, then the block's drafted tokens.
DEVICE int64_t sequence_at(const Args &a, int b, int k, int t) {
    return t < a.H ? a.history[(int64_t)b * a.H + t] : a.draft_vocab[a.draft_ids[(int64_t)b * a.G + (t - a.H)]];
}

// copy_bias.sequence_copy_candidates at the last position of history + x_1..x_{k-1} (length H + k),
// mapped to draft ids (draft_copy_candidates). One thread.
DEVICE void copy_candidates(const Args &a, int b, int k, int *out) {
    int length = a.H + k;
    for (int n = 1; n <= a.copy_ngram; ++n) {
        int found = NO_CANDIDATE;
        // the row has n tokens: the n-gram's first is inside the sequence and not left padding
        if (length - n >= 0 && sequence_at(a, b, k, length - n) != NO_CANDIDATE) {
            for (int j = length - 2; j >= 0 && found == NO_CANDIDATE; --j) {  // newest window first
                bool match = true;
                for (int i = 0; i < n && match; ++i) {
                    int64_t window = j - i >= 0 ? sequence_at(a, b, k, j - i) : NO_CANDIDATE;
                    match = window == sequence_at(a, b, k, length - 1 - i);
                }
                if (match) {
                    int64_t follower = sequence_at(a, b, k, j + 1);
                    int64_t column = follower >= 0 && follower < a.V_target ? a.to_draft[follower] : a.V;
                    found = column < a.V ? (int)column : NO_CANDIDATE;
                    if (found == NO_CANDIDATE) break;  // the newest match decides, in or out of the vocabulary
                }
            }
        }
        out[n - 1] = found;
    }
}

// Block-wide reductions over the partials (thread 0 combines; every thread reads the result).
DEVICE float block_max(Shared &s, int tid, int threads, float value) {
    s.partial[tid] = value;
    SYNC();
    if (tid == 0) {
        float best = s.partial[0];
        for (int t = 1; t < threads; ++t) best = fmaxf(best, s.partial[t]);
        s.scalars[0] = best;
    }
    SYNC();
    float result = s.scalars[0];
    SYNC();
    return result;
}

DEVICE float block_sum(Shared &s, int tid, int threads, float value) {
    s.partial[tid] = value;
    SYNC();
    if (tid == 0) {
        float total = 0.0f;
        for (int t = 0; t < threads; ++t) total += s.partial[t];
        s.scalars[0] = total;
    }
    SYNC();
    float result = s.scalars[0];
    SYNC();
    return result;
}

// The first index of the largest value (torch.argmax's tie rule).
DEVICE int block_argmax(Shared &s, int tid, int threads, const float *row, int V) {
    float best = -INFINITY;
    int index = V;
    for (int v = tid; v < V; v += threads)
        if (row[v] > best || (row[v] == best && v < index)) { best = row[v]; index = v; }
    s.partial[tid] = best;
    s.partial_index[tid] = index;
    SYNC();
    if (tid == 0) {
        for (int t = 1; t < threads; ++t)
            if (s.partial[t] > s.partial[0] || (s.partial[t] == s.partial[0] && s.partial_index[t] < s.partial_index[0])) {
                s.partial[0] = s.partial[t];
                s.partial_index[0] = s.partial_index[t];
            }
        s.ids[0] = s.partial_index[0];
    }
    SYNC();
    int result = s.ids[0];
    SYNC();
    return result;
}

DEVICE void draft_row(const Args &a, int b, int tid, int threads, Shared &s) {
    const int V = a.V, D = a.D, R = a.R;
    for (int r = tid; r < R; r += threads) s.state[r] = 0.0f;
    int64_t previous = a.anchor_ids[b];  // draft id of x_{k-1} (V: outside the draft vocabulary)
    SYNC();
    for (int k = 0; k < a.G; ++k) {
        const float *hidden = a.hidden + ((int64_t)b * a.G + k) * D;
        float *row = a.distributions + ((int64_t)b * a.G + k) * V;  // the slot's logits, then p_k
        const bool use_previous = a.head != HEAD_NONE || a.has_confidence;
        for (int r = tid; r < R; r += threads) s.previous[r] = use_previous ? a.w1[previous * R + r] : 0.0f;
        SYNC();
        if (a.head == HEAD_RNN) {  // s_k = GRU([W1[x_{k-1}]; h_k], s_{k-1}), gate order r, z, n
            for (int g = tid; g < 3 * R; g += threads) {
                float gi = a.gru_b_ih[g], gh = a.gru_b_hh[g];
                const float *wi = a.gru_w_ih + (int64_t)g * (R + D), *wh = a.gru_w_hh + (int64_t)g * R;
                for (int i = 0; i < R; ++i) gi += wi[i] * s.previous[i];
                for (int i = 0; i < D; ++i) gi += wi[R + i] * hidden[i];
                for (int i = 0; i < R; ++i) gh += wh[i] * s.state[i];
                s.gates[g] = gi;
                s.gates[3 * R + g] = gh;
            }
            SYNC();
            for (int r = tid; r < R; r += threads) {
                float reset = sigmoid_f(s.gates[r] + s.gates[3 * R + r]);
                float update = sigmoid_f(s.gates[R + r] + s.gates[4 * R + r]);
                float fresh = tanhf(s.gates[2 * R + r] + reset * s.gates[5 * R + r]);
                s.gates[r] = (1.0f - update) * fresh + update * s.state[r];  // the new state, kept apart
            }
            SYNC();
            for (int r = tid; r < R; r += threads) s.state[r] = s.gates[r];
            SYNC();
        }
        const float *source = a.head == HEAD_RNN ? s.state : s.previous;
        for (int v = tid; v < V; v += threads) {
            float value = a.logits[((int64_t)b * a.G + k) * V + v];
            if (a.head != HEAD_NONE) {
                float bias = 0.0f;
                for (int r = 0; r < R; ++r) bias += source[r] * a.w2[(int64_t)r * V + v];
                value += bias;
            }
            row[v] = value;
        }
        if (a.copy_ngram && tid == 0) copy_candidates(a, b, k, s.candidates);
        SYNC();
        if (a.copy_ngram && tid == 0)  // n by n, in order (add_copy_bias)
            for (int n = 0; n < a.copy_ngram; ++n)
                if (s.candidates[n] != NO_CANDIDATE) row[s.candidates[n]] += a.copy_alpha[k * a.N + n];
        SYNC();
        // Confidence inputs read the final logits (before the temperature): the top-probability logit.
        float top_logit = 0.0f;
        const int top = block_argmax(s, tid, threads, row, V);
        if (a.has_confidence && a.top_prob) {
            float top_value = row[top], others = 0.0f;
            for (int v = tid; v < V; v += threads) others += v == top ? 0.0f : expf(row[v] - top_value);
            others = block_sum(s, tid, threads, others);
            top_logit = fminf(-logf(others), TOP_PROBABILITY_LOGIT_CAP);
        }
        const float temperature = a.temperatures[b];
        const bool greedy = temperature <= 0.0f;
        const float scale = greedy ? 1.0f : temperature;
        float local_max = -INFINITY;
        for (int v = tid; v < V; v += threads) local_max = fmaxf(local_max, row[v] / scale);
        const float max_scaled = block_max(s, tid, threads, local_max);
        float local_sum = 0.0f;
        for (int v = tid; v < V; v += threads) local_sum += expf(row[v] / scale - max_scaled);
        const float total = block_sum(s, tid, threads, local_sum);
        for (int v = tid; v < V; v += threads) row[v] = expf(row[v] / scale - max_scaled) / total;
        SYNC();
        if (tid == 0) {
            int choice = top;  // greedy: the argmax of the logits
            if (!greedy) {  // the inverse CDF: the first index whose cumulative mass exceeds u * total
                float mass = 0.0f;
                for (int v = 0; v < V; ++v) mass += row[v];
                const float threshold = a.uniforms[(int64_t)b * a.G + k] * mass;
                float cumulative = 0.0f;
                choice = V - 1;
                for (int v = 0; v < V; ++v) {
                    cumulative += row[v];
                    if (cumulative > threshold) { choice = v; break; }
                }
            }
            float confidence = 1.0f;
            if (a.has_confidence) {
                float z = a.conf_b[0];
                for (int i = 0; i < D; ++i) z += hidden[i] * a.conf_w[i];
                for (int r = 0; r < R; ++r) z += s.previous[r] * a.conf_w[D + r];
                if (a.copy_ngram && a.copy_confidence)
                    for (int n = 0; n < a.copy_ngram; ++n)
                        z += s.candidates[n] != NO_CANDIDATE ? a.copy_beta[k * a.N + n] : 0.0f;
                if (a.top_prob) z += a.top_prob_w[k] * top_logit;
                confidence = sigmoid_f(z * a.conf_inv_temps[k]);
            }
            a.draft_ids[(int64_t)b * a.G + k] = choice;
            a.token_probs[(int64_t)b * a.G + k] = row[choice];
            a.confidences[(int64_t)b * a.G + k] = confidence;
            s.ids[1] = choice;
        }
        SYNC();
        previous = s.ids[1];
        SYNC();
    }
}

#define KERNEL_PARAMETERS                                                                                      \
    const float *logits, const float *hidden, const int64_t *anchor_ids, const float *w1, const float *w2,      \
        const float *gru_w_ih, const float *gru_w_hh, const float *gru_b_ih, const float *gru_b_hh,             \
        const float *conf_w, const float *conf_b, const float *conf_inv_temps, const float *temperatures,       \
        const float *uniforms, const int64_t *history, const int64_t *draft_vocab, const int64_t *to_draft,     \
        const float *copy_alpha, const float *copy_beta, const float *top_prob_w, int B, int G, int V, int D,   \
        int R, int H, int N, int V_target, int head, int has_confidence, int copy_ngram, int copy_confidence,   \
        int top_prob, int64_t *draft_ids, float *token_probs, float *confidences, float *distributions

#define KERNEL_ARGS                                                                                            \
    Args a = {logits, hidden, anchor_ids, w1, w2, gru_w_ih, gru_w_hh, gru_b_ih, gru_b_hh, conf_w, conf_b,       \
              conf_inv_temps, temperatures, uniforms, history, draft_vocab, to_draft, copy_alpha, copy_beta,   \
              top_prob_w, B, G, V, D, R, H, N, V_target, head, has_confidence, copy_ngram, copy_confidence,    \
              top_prob, draft_ids, token_probs, confidences, distributions}

#ifdef DSPARK_HOST
// The host build: every row, one "thread" (the same routine, serially).
extern "C" int sequential_draft_host(KERNEL_PARAMETERS) {
    KERNEL_ARGS;
    if (copy_ngram > MAX_NGRAM) return 1;
    float partial[1], scalars[2], *state = new float[R > 0 ? R : 1], *prev = new float[R > 0 ? R : 1];
    float *gates = new float[R > 0 ? 6 * R : 1];
    int partial_index[1], candidates[MAX_NGRAM], ids[2];
    Shared s = {partial, partial_index, state, prev, gates, candidates, scalars, ids};
    for (int b = 0; b < B; ++b) draft_row(a, b, 0, 1, s);
    delete[] state;
    delete[] prev;
    delete[] gates;
    return 0;
}
#else
// One block per row (grid_x = B); dynamic shared memory: threads * 2 words + (8R + MAX_NGRAM + 4) words
// (the last 4: two reduction results, two ids).
extern "C" __global__ void sequential_draft(KERNEL_PARAMETERS) {
    KERNEL_ARGS;
    extern __shared__ float shared[];
    const int threads = blockDim.x;
    Shared s;
    s.partial = shared;
    s.partial_index = (int *)(shared + threads);
    s.state = shared + 2 * threads;
    s.previous = s.state + R;
    s.gates = s.previous + R;
    s.candidates = (int *)(s.gates + 6 * R);
    s.scalars = (float *)(s.candidates + MAX_NGRAM);
    s.ids = (int *)(s.scalars + 2);
    draft_row(a, blockIdx.x, threadIdx.x, threads, s);
}
#endif
