"""`pdcluster train-draft`: its arguments and the summary it prints (spec/train does the work)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.commands.cli_args import add_model_args, layer_list

# spec.train.steps.STEP_WEIGHTINGS, written out: importing spec here would load torch for
# every command (TrainDraftConfig checks the name again).
STEP_WEIGHTINGS = ("uniform", "accepted")


def run_train_draft(args: argparse.Namespace) -> None:
    from spec.train.corpus_report import report_lines
    from spec.train.pipeline import TrainDraftConfig, train_draft
    from spec.train.trainer import Schedule

    config = TrainDraftConfig(
        out_dir=args.out,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        num_draft_steps=args.num_draft_steps,
        train_steps=args.train_steps,
        draft_intermediate_size=args.draft_intermediate_size,
        aux_layers=args.aux_layers or (),
        num_prompts=args.num_prompts,
        num_self_prompts=args.self_prompts,
        self_prompt_max_tokens=args.self_prompt_max_tokens,
        self_other_languages=args.self_other_languages,
        num_self_followups=args.self_followups,
        num_heldout=args.num_heldout,
        prompts_file=args.prompts,
        prompts_heldout_share=args.prompts_heldout_share,
        prompts_max_turns=args.prompts_max_turns,
        max_tokens=args.max_tokens,
        generate_batch=args.generate_batch,
        schedule=Schedule(
            epochs=args.epochs,
            tokens_per_batch=args.tokens_per_batch,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
            weight_decay=args.weight_decay,
            hidden_noise=args.hidden_noise,
            detach_between_depths=args.detach_between_depths,
            depth_loss_decay=args.depth_loss_decay,
            step_weighting=args.step_weights,
        ),
        save_dtype=args.save_dtype,
        draft_vocab_size=args.draft_vocab_size or None,
        restart=args.restart,
        generate_only=args.generate_only,
        data_from=tuple(args.data_from or ()),
        evaluate=not args.no_evaluate,
        compare_drafts=tuple(args.compare_draft or ()),
        progress=not args.no_progress,
    )
    summary = train_draft(config)
    print("\n".join(report_lines(summary["corpus"])))
    if config.generate_only:
        data = summary["data"]
        print(
            f"data in {config.out_dir}: {data['train_conversations']} training conversations, "
            f"{data['train_answer_tokens']} answer tokens ({summary['generate_s']:.0f} s)"
        )
        return
    print(f"draft written to {summary['draft']} ({summary['draft_bytes'] / 2**20:.1f} MiB)")
    for record in summary["validations"][-1:]:
        print(f"held-out replay: accept length {record['accept_length']:.2f}")
    vocab = summary["draft_vocab"]
    if vocab["restricted"]:
        print(
            f"draft vocabulary: {vocab['size']} tokens, "
            f"{vocab['heldout_answer_coverage']:.2%} of held-out answer tokens"
        )
    runs = [("", summary.get(key)) for key in ("engine_heldout", "engine_heldout_chains")]
    runs += [(f", {e['draft']}", e) for e in summary.get("engine_heldout_compared", [])]
    for which, engine in runs:
        if engine and engine["accept_length"] is not None:
            acceptance = ", ".join(f"{a:.2f}" for a in engine["acceptance"])
            print(
                f"held-out, engine{which}, {engine['draft_chains']} draft chain(s): accept "
                f"length {engine['accept_length']:.2f} (acceptance per draft position: "
                f"{acceptance})"
            )


def add_train_draft_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder (resumes what is there)")
    add_model_args(
        parser, "target model folder or GGUF (default: the embedded one)", "the target's dtype"
    )
    parser.add_argument("--num-draft-steps", type=int, default=3, help="draft depths K")
    parser.add_argument(
        "--train-steps",
        type=int,
        default=None,
        metavar="M",
        help="draft steps trained, at least K (default K): steps past the K depths run the "
        "last depth again, as an engine does; the saved draft runs M steps by default",
    )
    parser.add_argument(
        "--step-weights",
        choices=STEP_WEIGHTINGS,
        default="uniform",
        help="how each draft step's loss counts: uniform (default), or accepted: by the "
        "share of verify rounds that reach it (the product of the earlier steps' agreement)",
    )
    parser.add_argument(
        "--draft-intermediate-size",
        type=int,
        default=None,
        help="width of each depth's MLP (default: the target's intermediate_size); a "
        "narrower one fits more depths in the same bytes",
    )
    parser.add_argument(
        "--aux-layers",
        type=layer_list,
        default=None,
        metavar="L1,L2,...",
        help="target layers depth 0 reads side by side, EAGLE3 style (default: the last one)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=4000,
        help="training conversations from the written templates",
    )
    parser.add_argument(
        "--self-prompts",
        type=int,
        default=4000,
        metavar="N",
        help="training conversations whose user message the target writes itself (0: none)",
    )
    parser.add_argument(
        "--self-other-languages",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of self-written messages started in another language than English",
    )
    parser.add_argument(
        "--self-followups",
        type=int,
        default=0,
        metavar="N",
        help="three-turn conversations: a self-written one, its answer and a second user "
        "message the target writes (at most --self-prompts)",
    )
    parser.add_argument(
        "--self-prompt-max-tokens",
        type=int,
        default=96,
        help="length cap of a user message the target writes",
    )
    parser.add_argument(
        "--num-heldout", type=int, default=None, help="held-out conversations (default: all)"
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE",
        help="your own prompts, ShareGPT JSON or chat JSONL: their user turns are answered by "
        "the target and trained on",
    )
    parser.add_argument(
        "--prompts-heldout-share",
        type=float,
        default=0.05,
        metavar="SHARE",
        help="share of the --prompts conversations held out from training (default 0.05)",
    )
    parser.add_argument(
        "--prompts-max-turns",
        type=int,
        default=4,
        metavar="N",
        help="user turns answered per --prompts conversation (default 4)",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="answer length cap")
    parser.add_argument(
        "--generate-batch", type=int, default=128, help="requests the generating engine batches"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--tokens-per-batch", type=int, default=8192, help="padded tokens per training step"
    )
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument(
        "--hidden-noise",
        type=float,
        default=0.0,
        help="noise on the target hidden states in training, relative to their RMS",
    )
    parser.add_argument(
        "--detach-between-depths",
        action="store_true",
        help="a depth's loss trains that depth alone, not the depths whose outputs it reads",
    )
    parser.add_argument(
        "--depth-loss-decay",
        type=float,
        default=1.0,
        metavar="GAMMA",
        help="depth d's loss counts GAMMA**d in each step's total (default 1: all alike)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=200, help="steps")
    parser.add_argument(
        "--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"]
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=8192,
        metavar="N",
        help="tokens the draft may propose: the N most frequent in the training answers "
        "(default 8192; 0: the target's whole vocabulary)",
    )
    parser.add_argument(
        "--restart", action="store_true", help="ignore a checkpoint in --out (data is kept)"
    )
    parser.add_argument(
        "--generate-only",
        action="store_true",
        help="make the data in --out and stop (to train elsewhere with --data-from)",
    )
    parser.add_argument(
        "--data-from",
        action="append",
        metavar="DIR",
        help="also train on the answers generated in another --out folder (repeatable), "
        "e.g. by --generate-only runs with other --seed values on other GPUs",
    )
    parser.add_argument(
        "--no-evaluate", action="store_true", help="skip the engine run on held-out prompts"
    )
    parser.add_argument(
        "--compare-draft",
        action="append",
        metavar="DIR",
        help="after the new draft, the engine runs this draft folder (e.g. the shipped one) "
        "over the same held-out prompts, one chain, for figures from one engine (repeatable)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
