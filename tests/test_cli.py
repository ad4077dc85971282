"""The `pdcluster` command line: flags reach the engine options, bad input is a clear message."""

from __future__ import annotations

from cluster.commands.cli import build_parser, main
from cluster.commands.cli_commands import engine_args


def test_speculation_flags_reach_the_engine_options():
    args = build_parser().parse_args(
        [
            "serve",
            "--speculative-algorithm",
            "multi-layer-eagle",
            "--draft-model",
            "/d",
            "--num-draft-steps",
            "3",
            "--dtype",
            "bfloat16",
            "--prefill-nodes",
            "2",
        ]
    )
    options = engine_args(args)
    assert (options.speculative_algorithm, options.draft_model, options.num_draft_steps) == (
        "multi-layer-eagle",
        "/d",
        3,
    )
    assert options.dtype == "bfloat16" and args.prefill_nodes == 2


def test_a_missing_model_is_a_message_not_a_traceback(capsys):
    assert main(["generate", "--model", "/no/such/model", "hello"]) == 2
    err = capsys.readouterr().err
    assert "pdcluster: error:" in err and "/no/such/model" in err


def test_a_draft_without_an_algorithm_is_refused(capsys):
    assert main(["generate", "--draft-model", "/d", "hello"]) == 2
    assert "speculative_algorithm" in capsys.readouterr().err
