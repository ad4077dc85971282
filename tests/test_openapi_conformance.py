"""The served OpenAPI schema holds the server to what it answers: schemathesis generates requests
from /openapi.json (valid ones, invalid ones, boundary values, undocumented methods) against a
live server over the tiny model, and every answer must be documented (status, content type,
headers, body schema), none may be a 5xx, and every request the schema forbids must be refused.

One check is left out: positive_data_acceptance (every request the schema allows gets a 2xx).
Some limits depend on the served model and cannot be written in a static schema: a prompt plus
max_tokens within the context, token ids and top_k within the vocabulary, prompt_embeds as wide
as the hidden state; and OpenAI's fields that this server does not implement are accepted by
the schema so that their neutral values pass, and refused by name (a 400) otherwise."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.frontend.openai_api import BackgroundServer, create_app

# Per operation and phase; about 40 s for the whole run on two shared cores.
MAX_EXAMPLES = 50
SEED = 1


@pytest.fixture(scope="module")
def server(backend):
    with BackgroundServer(create_app(backend)) as server:
        yield server


def test_the_server_conforms_to_its_openapi_schema(server, tmp_path):
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{server.url}/openapi.json",
        "--checks=all",
        "--exclude-checks=positive_data_acceptance",
        f"--max-examples={MAX_EXAMPLES}",
        f"--seed={SEED}",
        "--no-color",
    ]
    # In a scratch directory: nothing the run may write lands in the repository.
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert "generated" in run.stdout and " passed" in run.stdout
