"""What a `pdcluster train-draft` run is asked to do (spec.train.pipeline does it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from spec.train.steps import STEP_WEIGHTINGS
from spec.train.trainer import Schedule

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# The second held-out measurement verifies this many chains a step, to show what they add.
HELDOUT_CHAINS = 4


@dataclass
class TrainDraftConfig:
    out_dir: Path
    model: str | None = None  # None: the embedded default model
    device: str | None = None
    dtype: str = "auto"
    num_draft_steps: int = 3
    # Draft steps trained (None: num_draft_steps): the steps past the depths run the last depth
    # again, as an engine does when it runs more steps than a draft has depths; the saved
    # folder tells the engine to run this many by default.
    train_steps: int | None = None
    # Width of each depth's MLP; None: the target's intermediate_size.
    draft_intermediate_size: int | None = None
    # Target layers depth 0 reads side by side (EAGLE3 style); () for the last layer's output.
    aux_layers: tuple[int, ...] = ()
    num_prompts: int = 4000  # conversations from the written templates (spec.train.prompts)
    num_self_prompts: int = 0  # conversations whose user message the target wrote
    self_prompt_max_tokens: int = 96
    # Of the self-written messages, the share that starts in another language than English.
    self_other_languages: float = 0.0
    # Three-turn conversations: a self-written conversation, its answer and a second user
    # message the target writes after them (at most one per self-written conversation).
    num_self_followups: int = 0
    num_heldout: int | None = None  # None: every held-out prompt
    # A user's prompts (spec.train.user_prompts): their user turns, answered by the target.
    prompts_file: Path | None = None
    # Of those conversations, the share held out (spec.train.user_split), never trained on.
    prompts_heldout_share: float = 0.05
    # User turns answered per conversation of the file, the target's answers in between.
    prompts_max_turns: int = 4
    max_tokens: int = 256
    generate_batch: int = 128
    schedule: Schedule = field(default_factory=Schedule)
    save_dtype: str = "bfloat16"
    # Tokens the draft may propose, the most frequent in the training answers (spec.draft_vocab);
    # no restriction when it is not below the target's vocabulary size, or None.
    draft_vocab_size: int | None = 8192
    restart: bool = False
    # Stop after generating the data: no training, no draft.
    generate_only: bool = False
    # Other output folders whose answer files are trained on too (same target, same max_tokens).
    data_from: tuple[Path, ...] = ()
    evaluate: bool = True
    # Other draft folders for the same target that the engine runs over the held-out set after
    # the new draft, in the same process: figures from one engine, where figures from an
    # earlier run may come from an engine that computed differently.
    compare_drafts: tuple[Path, ...] = ()
    progress: bool = True

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.data_from = tuple(Path(folder) for folder in self.data_from)
        self.compare_drafts = tuple(Path(folder) for folder in self.compare_drafts)
        if self.prompts_file is not None:
            self.prompts_file = Path(self.prompts_file)
        if self.compare_drafts and (not self.evaluate or self.generate_only):
            raise ValueError(
                "compare_drafts (--compare-draft) needs the held-out evaluation: not with "
                "--no-evaluate or --generate-only"
            )
        places = [folder.resolve() for folder in (self.out_dir, *self.data_from)]
        if len(set(places)) != len(places):
            raise ValueError("data_from must name other folders than out_dir, each once")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save_dtype must be one of {', '.join(SAVE_DTYPES)}")
        for name in (
            "num_draft_steps",
            "max_tokens",
            "generate_batch",
            "self_prompt_max_tokens",
            "prompts_max_turns",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_prompts < 0 or self.num_self_prompts < 0 or self.num_self_followups < 0:
            raise ValueError(
                "num_prompts, num_self_prompts and num_self_followups must not be negative"
            )
        if self.num_self_followups > self.num_self_prompts:
            raise ValueError(
                "each follow-up continues a self-written conversation: at most num_self_prompts"
            )
        if not 0.0 <= self.self_other_languages <= 1.0:
            raise ValueError(
                f"self_other_languages is a share in [0, 1], got {self.self_other_languages}"
            )
        if self.num_prompts + self.num_self_prompts < 1 and self.prompts_file is None:
            raise ValueError(
                "num_prompts and num_self_prompts add up to no training prompt, and no "
                "prompts file is given"
            )
        if not 0.0 <= self.prompts_heldout_share < 1.0:
            raise ValueError(
                f"prompts_heldout_share is a share in [0, 1), got {self.prompts_heldout_share}"
            )
        if self.train_steps is not None and self.train_steps < self.num_draft_steps:
            raise ValueError(
                f"train_steps ({self.train_steps}) must be at least num_draft_steps "
                f"({self.num_draft_steps}): every depth is trained"
            )
        if self.schedule.step_weighting not in STEP_WEIGHTINGS:
            raise ValueError(
                f"step_weighting must be one of {', '.join(STEP_WEIGHTINGS)}, got "
                f"{self.schedule.step_weighting!r}"
            )
        if self.draft_intermediate_size is not None and self.draft_intermediate_size < 1:
            raise ValueError(
                f"draft_intermediate_size must be positive, got {self.draft_intermediate_size}"
            )
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be positive, got {self.draft_vocab_size}")
        if self.schedule.epochs < 1 or self.schedule.tokens_per_batch < 2:
            raise ValueError("epochs must be >= 1 and tokens_per_batch >= 2")
        if not self.schedule.depth_loss_decay > 0:
            raise ValueError(
                f"depth_loss_decay must be positive, got {self.schedule.depth_loss_decay}"
            )

    @property
    def steps_trained(self) -> int:
        return self.train_steps or self.num_draft_steps
