"""From logits to tokens and stops: sampling parameters, the sampler and logits processors, grammars
and their masks, stopping, and what a verify hands back."""
