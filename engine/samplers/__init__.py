"""Logits processors behind `engine.sampling.Sampler`, one module per family.

- `penalties`: repetition, presence and frequency penalties, DRY, no_repeat_ngram.
- `bias`: logit_bias, banned tokens and the EOS masks (ban_eos_token, min_new_tokens).
- `temperature`: temperature, dynamic temperature, quadratic sampling (smoothing).
- `truncation`: top_k, top_p, min_p, typical_p, epsilon/eta cutoff, tfs, top_a, top_n_sigma.
- `stochastic`: XTC, mirostat 2 and the draw itself.
- `order`: TGW's sampler names and the order they run in (no torch).
- `parse`: validation helpers of `engine.sampling_settings` (no torch).
- `chain`: which steps a Sampler runs for its settings, and what a step is given.

Every processor is a pure function on float logits [B, V] that returns new logits: no loop
over the vocabulary in Python, no host sync, the input never modified. This package imports
nothing on its own, so that the settings module can use `order`/`parse` without torch.
"""
