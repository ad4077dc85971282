"""What a prompt prefilled in chunks keeps between its chunks for the draft extend for prefill,
which runs once, over the whole prompt, after the last chunk: the target's hidden states and
the input-embedding rows each chunk's forward read. The draft's prefill is not chunked: its one
layer per depth costs little next to the target's, and running it whole keeps one draft
extend for prefill for chunked and unchunked prompts alike."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.executor.prompt_embeds import InputEmbeds, concat_input_embeds


@dataclass
class HeldChunks:
    hidden: list[torch.Tensor] = field(default_factory=list)
    embeds: list[InputEmbeds | None] = field(default_factory=list)

    def add(self, hidden: torch.Tensor, embeds: InputEmbeds | None) -> None:
        self.hidden.append(hidden)
        self.embeds.append(embeds)

    def join(
        self, hidden: torch.Tensor, embeds: InputEmbeds | None
    ) -> tuple[torch.Tensor, InputEmbeds | None]:
        """The whole prompt's rows: the held chunks' followed by the last chunk's."""
        pieces = [*self.embeds, embeds]
        hiddens = [*self.hidden, hidden]
        lengths = [h.shape[0] for h in hiddens]
        values, mask = concat_input_embeds(pieces, lengths, hidden.device)
        joined = None if values is None else InputEmbeds(values, mask)
        return torch.cat(hiddens), joined
