"""The fused sampler's kernel body (Triton), wrapped by `triton_sampling`, which documents it.

Kept in a module of its own so that Triton is imported only when the kernel is first used (as
`paged_decode_kernel`).
"""

import triton.language as tl


def untruncated_sample_kernel(
    logits_ptr,
    temperature_ptr,
    uniforms_ptr,
    stats_ptr,
    tokens_ptr,
    logprobs_ptr,
    vocab,
    chunks,
    logits_stride,
    temperature_stride,
    CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    SCALE: tl.constexpr,
    RANDOM: tl.constexpr,
    GREEDY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_stride
    temperature = tl.load(temperature_ptr + row * temperature_stride)
    divisor = tl.where(temperature > 0, temperature, 1.0)
    offsets = tl.arange(0, CHUNK)
    stats = stats_ptr + row * chunks * 2

    # one read of the row: each chunk's max and sum of exp(score - max), the row's online log-sum-exp, the argmax
    running_max = float("-inf")
    running_sum = 0.0
    best_value = float("-inf")
    best_index = 0
    for chunk in range(0, chunks):
        index = chunk * CHUNK + offsets
        scores = tl.load(base + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
        if SCALE:
            scores = scores / divisor
        chunk_max = tl.max(scores, 0)
        chunk_sum = tl.sum(tl.exp(scores - chunk_max), 0)
        tl.store(stats + chunk * 2, chunk_max)
        tl.store(stats + chunk * 2 + 1, chunk_sum)
        new_max = tl.maximum(running_max, chunk_max)
        running_sum = running_sum * tl.exp(running_max - new_max) + chunk_sum * tl.exp(chunk_max - new_max)
        running_max = new_max
        if GREEDY:
            # the first maximal entry, as torch.argmax: strictly greater than every earlier chunk's maximum
            better = chunk_max > best_value
            best_index = tl.where(better, chunk * CHUNK + tl.argmax(scores, 0), best_index)
            best_value = tl.where(better, chunk_max, best_value)
    lse = running_max + tl.log(running_sum)

    token = best_index
    if RANDOM:
        # chunk masses exp(score - lse) summed per chunk, their float64 CDF, the chunk the uniform falls in
        chunk_ids = tl.arange(0, CHUNKS_PAD)
        present = chunk_ids < chunks
        maxima = tl.load(stats + chunk_ids * 2, mask=present, other=float("-inf"))
        sums = tl.load(stats + chunk_ids * 2 + 1, mask=present, other=0.0)
        masses = tl.where(present, sums * tl.exp(maxima - lse), 0.0).to(tl.float64)
        cdf = tl.cumsum(masses, 0)
        total = tl.max(cdf, 0)
        uniform = tl.minimum(tl.load(uniforms_ptr + row), 1.0 - 2.0**-52)
        target = uniform * total
        picked = tl.minimum(tl.sum((present & (cdf <= target)).to(tl.int32), 0), chunks - 1)
        before = tl.sum(tl.where(chunk_ids == picked - 1, cdf, 0.0), 0)
        # then the token inside that chunk: its float64 CDF of exp(score - lse)
        index = picked * CHUNK + offsets
        inside = index < vocab
        scores = tl.load(base + index, mask=inside, other=float("-inf")).to(tl.float32)
        if SCALE:
            scores = scores / divisor
        values = tl.where(inside, tl.exp(scores - lse), 0.0)
        within_cdf = tl.cumsum(values.to(tl.float64), 0)
        within = tl.sum((within_cdf <= target - before).to(tl.int32), 0)
        # the two float64 sums of one chunk may round differently: never past the chunk's last token with mass
        last = tl.max(tl.where(values > 0, offsets, 0), 0)
        drawn = picked * CHUNK + tl.minimum(within, last)
        if GREEDY:  # noqa: SIM108 (Triton resolves the constexpr branch at compile time)
            token = tl.where(temperature > 0, drawn, best_index)
        else:
            token = drawn
    score = tl.load(base + token).to(tl.float32)
    if SCALE:
        score = score / divisor
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, score - lse)
