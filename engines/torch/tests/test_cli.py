"""The command line as a supervisor uses it: make-model, then serve on a free port, announce the
address, answer over gRPC, stop cleanly on SIGTERM."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest

from slimen_torch.proto import engine_pb2 as pb
from slimen_torch.proto import engine_pb2_grpc as pb_grpc

PKG = pathlib.Path(__file__).resolve().parents[1]


def test_make_model_and_serve(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(PKG), TOK="t0ken")
    model = tmp_path / "m"
    subprocess.run([sys.executable, "-m", "slimen_torch", "make-model", "--shape", "tiny",
                    "--out", str(model)], check=True, env=env, capture_output=True)
    assert (model / "model.safetensors").exists() and (model / "tokenizer.json").exists()
    addr_file = tmp_path / "addr"
    proc = subprocess.Popen([sys.executable, "-m", "slimen_torch", "serve", "--model", str(model),
                             "--listen", "127.0.0.1:0", "--device", "cpu", "--token-env", "TOK",
                             "--root", str(tmp_path / "saves"),
                             "--address-file", str(addr_file)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while not addr_file.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "no address file"
            time.sleep(0.1)
        addr = addr_file.read_text().strip()
        assert addr.startswith("127.0.0.1:") and not addr.endswith(":0")
        md = [("authorization", "Bearer t0ken")]
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.EngineStub(ch)
            while stub.Health(pb.HealthRequest(), metadata=md).status != pb.HealthResponse.SERVING:
                assert time.time() < deadline, "never serving"
                time.sleep(0.1)
            req = pb.GenerateStreamRequest(requests=[pb.GenerateRequest(
                id="a", prompt_tokens=[5, 6, 7], sampling=pb.Sampling(max_tokens=4, seed=1))])
            got = [c for r in stub.Generate(iter([req]), metadata=md) for c in r.completions]
            assert [c.request_id for c in got] == ["a"] and 1 <= len(got[0].tokens) <= 4
            # Save and Load stay under --root.
            stub.Save(pb.SaveRequest(dir="step_1"), metadata=md)
            assert (tmp_path / "saves" / "step_1" / "config.json").exists()
            with pytest.raises(grpc.RpcError) as e:
                stub.Load(pb.LoadRequest(dir=str(model)), metadata=md)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_off_loopback_needs_a_token(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(PKG))
    p = subprocess.run([sys.executable, "-m", "slimen_torch", "serve", "--model", str(tmp_path),
                        "--listen", "0.0.0.0:0", "--device", "cpu"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "must authenticate its clients" in p.stderr, p.stderr
