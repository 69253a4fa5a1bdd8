"""Batch files never lose lines: a request that fails for any reason gets its own error line, an interrupted job
leaves whole lines of what it finished and exits non-zero, and --resume answers only what is missing."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import devices_of_its_own

from jaxinfer import SamplingParams
from jaxinfer.launch import main, parse_args
from jaxinfer.serve.batch_job import BatchInterrupted, answer, run_batch_file
from jaxinfer.serve.openai_api import OpenAIServing

NAME = "tiny-llama"
PROMPTS = ["The quick brown fox", "Ring", "Distributed inference splits a model", "All-reduce and all-gather"]
FAULT = "this prompt makes the server fail"
HANG = "this prompt is never answered"


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm(max_tokens_per_step=64)


def line(custom_id, prompt: str, max_tokens: int = 4) -> dict:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def write_jsonl(path, items: list[dict]):
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


def greedy(llm, prompt: str, max_tokens: int = 4) -> str:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].text


def text(result: dict) -> str:
    return result["response"]["body"]["choices"][0]["text"]


class Hooks:
    """What reaches OpenAIServing.completions: `seen` the prompts as they come, `answered` those answered. FAULT
    raises a RuntimeError there (a fault no request check catches); HANG never returns until cancelled."""

    def __init__(self):
        self.seen, self.answered = [], []


@pytest.fixture
def hooks(monkeypatch) -> Hooks:
    hooks, real = Hooks(), OpenAIServing.completions

    async def completions(self, req):
        hooks.seen.append(req.prompt)
        if req.prompt == FAULT:
            raise RuntimeError("injected fault")
        if req.prompt == HANG:
            await asyncio.Event().wait()
        response = await real(self, req)
        hooks.answered.append(req.prompt)
        return response

    monkeypatch.setattr(OpenAIServing, "completions", completions)
    return hooks


def test_a_request_that_fails_unexpectedly_gets_a_500_line_and_the_others_are_answered(llm, tmp_path, hooks):
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    src = write_jsonl(tmp_path / "requests.jsonl", [
        line("a", PROMPTS[0]), line("boom", FAULT),
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat}, line("d", PROMPTS[1])])
    out = tmp_path / "results.jsonl"
    counts = run_batch_file(llm, NAME, src, out)
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert counts == {"requests": 4, "succeeded": 3, "failed": 1}
    assert [r["custom_id"] for r in results] == ["a", "boom", "c", "d"]
    boom = results[1]["response"]
    assert boom["status_code"] == 500 and boom["request_id"] and results[1]["error"] is None
    assert boom["body"] == {"error": {"message": "the request failed: RuntimeError: injected fault",
                                      "type": "internal_server_error", "param": None, "code": None}}
    assert text(results[0]) == greedy(llm, PROMPTS[0]) and text(results[3]) == greedy(llm, PROMPTS[1])
    expected_chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3, temperature=0))[0]
    assert results[2]["response"]["body"]["choices"][0]["message"]["content"] == expected_chat.text


@pytest.mark.parametrize("stop", [asyncio.CancelledError, KeyboardInterrupt])
def test_cancellation_and_ctrl_c_are_not_line_errors(llm, monkeypatch, stop):
    async def completions(self, req):
        raise stop()

    monkeypatch.setattr(OpenAIServing, "completions", completions)
    with pytest.raises(stop):
        asyncio.run(answer(OpenAIServing(llm, NAME), json.dumps(line("a", PROMPTS[0]))))


def test_resume_answers_only_the_missing_custom_ids_and_keeps_the_lines_there(llm, tmp_path, hooks):
    items = [line(f"r{i}", p) for i, p in enumerate(PROMPTS)] + [line(None, PROMPTS[0], max_tokens=2)]
    src, out = write_jsonl(tmp_path / "requests.jsonl", items), tmp_path / "results.jsonl"
    run_batch_file(llm, NAME, write_jsonl(tmp_path / "first.jsonl", [items[0], items[2], items[4]]), out)
    kept = [x for x in out.read_bytes().splitlines(keepends=True) if json.loads(x)["custom_id"] is not None]
    assert len(kept) == 2
    cut = json.dumps({"id": "batch-x", "custom_id": "r3", "response": {"status_code": 200, "body": {}}})
    with open(out, "ab") as f:
        f.write(cut[:40].encode())  # a job killed mid-write: r3's line cut short
    hooks.seen.clear()

    counts = run_batch_file(llm, NAME, src, out, resume=True)
    assert counts == {"requests": 5, "succeeded": 3, "failed": 0, "skipped": 2}
    assert sorted(hooks.seen) == sorted([PROMPTS[1], PROMPTS[3], PROMPTS[0]])  # r1, r3, the line without an id
    data = out.read_bytes()
    assert data.startswith(b"".join(kept)) and data.endswith(b"\n")
    results = {r["custom_id"]: r for r in map(json.loads, data.splitlines())}
    assert len(data.splitlines()) == len(results) == 5
    for i, p in enumerate(PROMPTS):
        assert text(results[f"r{i}"]) == greedy(llm, p)
    assert text(results[None]) == greedy(llm, PROMPTS[0], max_tokens=2)

    hooks.seen.clear()
    assert run_batch_file(llm, NAME, src, out, resume=True) == {"requests": 5, "succeeded": 1, "failed": 0,
                                                                   "skipped": 4}
    assert hooks.seen == [PROMPTS[0]]  # only the line without a custom_id: it cannot be matched
    assert out.read_bytes().splitlines()[:4] == data.splitlines()[:4]

    assert run_batch_file(llm, NAME, src, out) == {"requests": 5, "succeeded": 5, "failed": 0}  # overwrites
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["r0", "r1", "r2", "r3", None]


def test_resume_refuses_an_output_file_that_is_not_results(llm, tmp_path):
    src = write_jsonl(tmp_path / "requests.jsonl", [line("a", PROMPTS[0])])
    out = tmp_path / "results.jsonl"
    out.write_text("some notes\n")
    with pytest.raises(ValueError, match="line 1 is not a batch result line"):
        run_batch_file(llm, NAME, src, out, resume=True)
    assert out.read_text() == "some notes\n"


def test_sigint_keeps_every_finished_line_whole(llm, tmp_path, hooks):
    """r0 and r2 are answered while r1 hangs: r2 waits behind r1 for its turn in input order, and the interrupt
    writes it anyway, then cancels r1."""
    items = [line("r0", PROMPTS[0]), line("r1", HANG), line("r2", PROMPTS[2])]
    src, out = write_jsonl(tmp_path / "requests.jsonl", items), tmp_path / "results.jsonl"

    def interrupt():  # once r0 and r2 are answered and r0 is written (or after a minute: r1 never ends)
        deadline = time.time() + 60
        while (len(hooks.answered) < 2 or not (out.exists() and out.stat().st_size)) and time.time() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(BatchInterrupted) as stopped:
        run_batch_file(llm, NAME, src, out)
    assert stopped.value.signum == signal.SIGINT
    assert stopped.value.counts == {"requests": 3, "succeeded": 2, "failed": 0}
    data = out.read_text()
    results = [json.loads(x) for x in data.splitlines()]
    assert data.endswith("\n") and [r["custom_id"] for r in results] == ["r0", "r2"]
    assert text(results[0]) == greedy(llm, PROMPTS[0]) and text(results[1]) == greedy(llm, PROMPTS[2])

    items[1] = line("r1", PROMPTS[1])
    write_jsonl(src, items)
    hooks.seen.clear()
    assert run_batch_file(llm, NAME, src, out, resume=True) == {"requests": 3, "succeeded": 1, "failed": 0,
                                                                   "skipped": 2}
    r1 = json.loads(out.read_text().splitlines()[-1])
    assert hooks.seen == [PROMPTS[1]] and r1["custom_id"] == "r1" and text(r1) == greedy(llm, PROMPTS[1])


def test_a_repeated_custom_id_is_refused_before_the_model_loads(llm, tmp_path, capsys):
    src = write_jsonl(tmp_path / "requests.jsonl", [line("a", PROMPTS[0]), line("dup", PROMPTS[1]),
                                                    line("dup", PROMPTS[2])])
    out = tmp_path / "results.jsonl"
    with pytest.raises(ValueError, match='custom_id "dup" is on lines 2 and 3'):
        run_batch_file(llm, NAME, src, out)
    assert main(["--input", str(src), "--output", str(out)]) == 2
    assert 'custom_id "dup" is on lines 2 and 3' in capsys.readouterr().err
    assert not out.exists()


def test_resume_needs_input(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--resume"])
    assert e.value.code == 2 and "--resume needs --input and --output" in capsys.readouterr().err


def test_sigterm_mid_job_then_resume_gives_one_line_per_request(tmp_path, subprocess_env):
    """The CLI on the embedded default model: SIGTERM once the first line is written exits 143 with whole lines
    only (the long requests cancelled); a --resume run completes the file. Requests with the same body give the
    same text in either run."""
    short = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    long = short | {"max_tokens": 600}
    bodies = [short, long, short, long, long]
    items = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": b}
             for i, b in enumerate(bodies)]
    src, out = write_jsonl(tmp_path / "requests.jsonl", items), tmp_path / "results.jsonl"
    env = devices_of_its_own(subprocess_env)
    cmd = [sys.executable, "-m", "jaxinfer.launch", "--input", str(src), "--output", str(out)]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not (out.exists() and out.stat().st_size):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    assert "interrupted by SIGTERM" in stderr and "--resume" in stderr
    first = out.read_bytes()
    done = [json.loads(x) for x in first.decode().splitlines()]
    ids = [r["custom_id"] for r in done]  # r2 too if it was answered as the signal came: out of input order
    assert first.endswith(b"\n") and ids in (["r0"], ["r0", "r2"])

    resumed = subprocess.run([*cmd, "--resume", "--json"], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    counts = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert counts == {"requests": 5, "succeeded": 5 - len(ids), "failed": 0, "skipped": len(ids)}
    data = out.read_bytes()
    assert data.startswith(first)
    results = [json.loads(x) for x in data.decode().splitlines()]
    assert sorted(r["custom_id"] for r in results) == [f"r{i}" for i in range(5)]
    by_id = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in results}
    for i, body in enumerate(bodies):
        assert by_id[f"r{i}"]["finish_reason"] == "length"
        assert by_id[f"r{i}"]["text"] == by_id["r0" if body is short else "r1"]["text"]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == bodies[int(r["custom_id"][1:])]["max_tokens"]
               for r in results)
