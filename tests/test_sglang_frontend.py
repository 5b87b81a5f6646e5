"""SGLang's own frontend (the `sglang` 0.5.23 package's RuntimeEndpoint) running programs against `sgl-lite serve`
on the tiny random model: gen, regex gen, select, fork, run_batch and streaming.

`sglang` is installed without its dependencies (scripts/install.sh: they are its GPU runtime's); it imports
with the ones sgl_lite has plus pybase64. Its programs run in a child process, since `import sglang` patches
transformers in the importing process. Expected values come from the same programs under sgl_lite's own
frontend on the same server, and select's from the server's logprobs under SGLang's scoring rule.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx2
import pytest

from sgl_lite.lang.launcher import Runtime

pytestmark = pytest.mark.timeout(300)

# One program source for both frontends: `frontend` is the module (sglang, or sgl_lite), argv[2] the server's URL.
PROGRAMS = r'''
import importlib, json, sys
sgl = importlib.import_module(sys.argv[1])

@sgl.function
def qa(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6, temperature=0)
    s += "\nNumber: " + sgl.gen("number", max_tokens=4, regex=r"[0-9]{2}", temperature=0)
    s += "\nVerdict:" + sgl.select("verdict", choices=[" yes", " no", " maybe"], temperature=0)

@sgl.function
def tips(s):
    s += "Two tips:"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" Tip {i + 1}:" + sgl.gen("tip", max_tokens=4, temperature=0)
    s += "|".join(f["tip"] for f in forks)

backend = sgl.RuntimeEndpoint(sys.argv[2])
one = qa.run(question="Is water wet?", backend=backend)
batch = qa.run_batch([{"question": q} for q in ("Is fire hot?", "Is ice cold?")], backend=backend)
streamed = qa.run(question="Is water wet?", backend=backend, stream=True)
pieces = list(streamed.text_iter("answer"))
print(json.dumps({
    "runs": [{key: state[key] for key in ("answer", "number", "verdict")} for state in [one, *batch]],
    "texts": [state.text() for state in [one, *batch]],
    "tips": tips.run(backend=backend).text(),
    "streamed": ["".join(pieces), streamed["answer"]],
}))
'''


def run_programs(frontend: str, url: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", PROGRAMS, frontend, url], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sglang_importable() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang's frontend is not installed: `pip install --no-deps sglang==0.5.23 pybase64` "
                    "(scripts/install.sh does)")
    check = subprocess.run([sys.executable, "-c", "import sglang; sglang.RuntimeEndpoint"], capture_output=True,
                           text=True, timeout=240)
    if check.returncode != 0:
        pytest.skip(f"the installed sglang does not import here: {check.stderr.strip().splitlines()[-1:]}")


@pytest.fixture(scope="module")
def server(sglang_importable: None, tiny_llama_dir: Path) -> Iterator[Runtime]:
    with Runtime(model_path=str(tiny_llama_dir), startup_timeout=180, dtype="float32") as runtime:
        yield runtime


def sglang_select(url: str, text: str, choices: list[str]) -> str:
    """The choice SGLang 0.5.23's RuntimeEndpoint.select picks (token_length_normalized) from this server's
    logprobs: the mean input logprob from two tokens before the choice, the first of them left out when the
    text ends with its text (token healing)."""
    prompt_len = httpx2.post(url + "/generate", timeout=60, json={"text": text, "sampling_params": {
        "max_new_tokens": 0}}).json()["meta_info"]["prompt_tokens"]
    replies = httpx2.post(url + "/generate", timeout=60, json={
        "text": [text + c for c in choices], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": max(prompt_len - 2, 0)}).json()
    scores = []
    for reply in replies:
        entries = reply["meta_info"]["input_token_logprobs"]
        if text.endswith(entries[0][2]):
            entries = entries[1:]
        scores.append(sum(e[0] for e in entries) / len(entries))
    return choices[scores.index(max(scores))]


def test_sglangs_frontend_runs_programs_on_sgl_lite(server: Runtime) -> None:
    theirs = run_programs("sglang", server.url)
    ours = run_programs("sgl_lite", server.url)
    # gen, regex gen and run_batch: what sgl_lite's frontend gets from the same server, field by field.
    for their_run, our_run in zip(theirs["runs"], ours["runs"]):
        assert (their_run["answer"], their_run["number"]) == (our_run["answer"], our_run["number"])
        assert len(their_run["number"]) == 2 and their_run["number"].isdigit()
    assert len(theirs["runs"]) == 3
    # fork: both branches generated and joined into the parent, as sgl_lite's frontend does it.
    assert theirs["tips"] == ours["tips"] and theirs["tips"].count("|") == 1
    # streaming: the pieces add up to the variable, and to the same answer as without streaming.
    assert theirs["streamed"] == [theirs["runs"][0]["answer"]] * 2
    # select: the choice SGLang's own scoring makes of this server's logprobs.
    for run, text in zip(theirs["runs"], theirs["texts"]):
        before_choice = text[: text.rindex("\nVerdict:") + len("\nVerdict:")]
        assert run["verdict"] == sglang_select(server.url, before_choice, [" yes", " no", " maybe"])
