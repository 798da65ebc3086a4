/* The value of the last \boxed{...} before the first EOS of each row: MathAnswerReward's default read, fused.
 *
 * The same computation as the torch-op path (trl_async/rewards/literal.py: last_literal, then
 * trl_async/rewards/boxed_tokens.py: BoxedTokenReader.read), on the same tables, one row at a time: a scan of the
 * row's tokens through the packed literal automaton up to the first EOS, then a read of at most `window` pieces
 * after the last opener. The torch path composes in parallel trees what this does in sequential folds; the
 * monoid is associative and the reductions are sums and maxima, so the results are identical (tested).
 *
 * No allocation, no global state, no locks: safe to call from several threads at once. Built by
 * trl_async/rewards/native.py with the system C compiler; plain C99, no Python or torch headers.
 */
#include <stdint.h>

#define MAX_DIGITS 18
#define MAX_DEPTH 16

/* Tables, all indexed as in the Python modules that own them. Layout must match native.py's BoxTables. */
typedef struct {
    /* PackedLiteral (literal.py): rows by key = clamp(id, -1, V) + 1, keys 0 and V + 1 are null */
    const int32_t *code;         /* (V + 2,) byte 0 pre, 1 mid, 2 post, 3: bits 0-3 shift, 4 full, 5 EOS */
    const uint8_t *relevant;     /* (ceil(V / 8),) bit (id & 7) of byte id >> 3: code[id + 1] != 0 */
    const int64_t *full_after;   /* (V + 2,) character offset after the last occurrence inside the token */
    const int64_t *crossing_end; /* (256,) offset after a match that began in earlier tokens, by `ends` byte */
    int64_t vocab_size;          /* V */
    /* BoxedTokenReader (boxed_tokens.py): rows by piece */
    const int32_t *suffix_base;  /* (V + 2,) */
    const int32_t *closing_base; /* (R,) */
    const int32_t *function;     /* (R,) monoid element */
    const int32_t *depth_change; /* (R,) */
    const int32_t *lowest;       /* (R,) */
    const int32_t *caret;        /* (R,) */
    const int32_t *n_digits;     /* (R,) */
    const int64_t *digit_value;  /* (R,) */
    const int32_t *after_dot;    /* (R,) */
    const int32_t *minus_first;  /* (R,) */
    int64_t n_pieces;            /* R */
    /* BoxedAutomaton (boxed_automaton.py) */
    const int32_t *compose;      /* (F * F,) compose[a * F + b]: a's string, then b's */
    const uint8_t *accepts;      /* (F,) bool */
    int64_t n_functions;         /* F */
} BoxTables;

static const double POW10F[MAX_DIGITS + 1] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8, 1e9,
                                              1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18};

/* The row of token id in the key space: clamp(id, -1, V) + 1, and 0 outside the mask (0 and V + 1 are null). */
static int64_t key_of(int64_t id, uint8_t inside, int64_t vocab_size) {
    if (!inside || id < 0) return 0;
    return id >= vocab_size ? vocab_size + 1 : id + 1;
}

/* The box content from character `offset` of token `start` on; 1 when it holds a number, its value in *out. */
static int read_box(const BoxTables *t, const int64_t *ids, const uint8_t *mask, int64_t start, int64_t offset,
                    int64_t end, int64_t window, double *out) {
    int64_t pieces[256]; /* window <= 256 (checked by the caller) */
    int64_t head = t->suffix_base[key_of(ids[start], mask[start], t->vocab_size)] + offset;
    pieces[0] = head < 0 ? 0 : head > t->n_pieces - 1 ? t->n_pieces - 1 : head;
    for (int64_t j = 1; j < window; j++) {
        int64_t i = start + j;
        pieces[j] = i < end ? key_of(ids[i], mask[i], t->vocab_size) : 0;
    }
    /* the closing piece: the first whose lowest running depth, from its entry depth, goes below zero */
    int64_t closing = window, depth = 0;
    for (int64_t j = 0; j < window; j++) {
        if (depth + t->lowest[pieces[j]] < 0) {
            closing = j;
            break;
        }
        depth += t->depth_change[pieces[j]];
    }
    if (closing == window || depth >= MAX_DEPTH) return 0;
    int64_t closer = t->closing_base[pieces[closing]] + depth;
    pieces[closing] = closer > t->n_pieces - 1 ? t->n_pieces - 1 : closer;
    int64_t n = closing + 1; /* the content's pieces, the closer's text before the brace last */
    /* the grammar: fold the pieces' monoid elements */
    int64_t f = 0; /* identity */
    for (int64_t j = 0; j < n; j++) f = t->compose[f * t->n_functions + t->function[pieces[j]]];
    if (!t->accepts[f]) return 0;
    /* the value: digits of the pieces up to the first one holding a '^' (later digits are unit exponents) */
    int64_t total = 0, digit_pieces = n;
    for (int64_t j = 0; j < n; j++) {
        total += t->n_digits[pieces[j]];
        if (t->caret[pieces[j]]) {
            digit_pieces = j + 1;
            break;
        }
    }
    if (total > MAX_DIGITS) return 0;
    uint64_t mantissa = 0;
    int64_t seen = 0, fraction = 0, negative = 0;
    for (int64_t j = 0; j < digit_pieces; j++) {
        int64_t p = pieces[j], count = t->n_digits[p];
        if (t->minus_first[p] && seen == 0) negative = 1; /* a '-' with no digit before it */
        for (int64_t k = 0; k < count; k++) mantissa *= 10;
        mantissa += (uint64_t)t->digit_value[p];
        seen += count;
        int64_t after_first_dot = t->after_dot[p] + (total - seen); /* negative when the piece has no '.' */
        if (after_first_dot > fraction) fraction = after_first_dot;
    }
    if (fraction > MAX_DIGITS) fraction = MAX_DIGITS;
    double value = (double)(int64_t)mantissa / POW10F[fraction];
    *out = negative ? -value : value;
    return 1;
}

/* ids (B, L) int64, mask (B, L) uint8, C-contiguous; value (B,) float64 (0 where not found), found (B,) uint8.
 * With a target (B,) float64 (may be NULL), also reward (B,) float32: 1 where found and
 * |value - target| <= abs_tol + rel_tol * |target| (never for a NaN target), as MathAnswerReward.score compares.
 * Returns 0, or -1 when window is out of range. */
int trl_last_box(const BoxTables *t, const int64_t *ids, const uint8_t *mask, int64_t batch, int64_t length,
                 int64_t window, const double *target, double abs_tol, double rel_tol, double *value,
                 uint8_t *found, float *reward) {
    if (window < 1 || window > 256) return -1;
    const uint64_t vocab_size = (uint64_t)t->vocab_size;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t *row = ids + b * length;
        const uint8_t *row_mask = mask + b * length;
        uint32_t state = 0; /* partial matches alive after the previous token: bit k, S[:k] consumed */
        int64_t last = -1, last_key = 0, end = length;
        uint32_t last_ends = 0;
        for (int64_t i = 0; i < length; i++) {
            uint64_t id = (uint64_t)row[i];
            if (id < vocab_size && !((t->relevant[id >> 3] >> (id & 7)) & 1)) {
                state = 0; /* most tokens: no part of the opener, no EOS, masked or not */
                continue;
            }
            int64_t key = key_of(row[i], row_mask[i], t->vocab_size);
            uint32_t code = (uint32_t)t->code[key];
            uint32_t flags = code >> 24;
            if (flags & 32) { /* the first EOS */
                end = i;
                break;
            }
            uint32_t ends = state & (code >> 16) & 0xFF; /* bit j: a match that had consumed S[:j] ends here */
            state = ((code & 0xFF) | ((state & (code >> 8)) << (flags & 15))) & 0xFF;
            if (ends || (flags & 16)) {
                last = i;
                last_key = key;
                last_ends = ends;
            }
        }
        double v = 0.0;
        int ok = 0;
        if (last >= 0) {
            int64_t full = t->full_after[last_key], crossing = t->crossing_end[last_ends];
            ok = read_box(t, row, row_mask, last, full > crossing ? full : crossing, end, window, &v);
        }
        value[b] = ok ? v : 0.0;
        found[b] = (uint8_t)ok;
        if (target) {
            double error = v - target[b], scale = target[b];
            error = error < 0 ? -error : error; /* NaN stays NaN: the comparison below is false */
            scale = scale < 0 ? -scale : scale;
            reward[b] = ok && error <= abs_tol + rel_tol * scale ? 1.0f : 0.0f;
        }
    }
    return 0;
}
