"""Tests of the flywheel Python client against the in-process fake publisher.

Run: /usr/bin/python3 -m pytest tests/python -q
"""

import hashlib
import io
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import pytest

import flywheel
from fake_publisher import ApiFailure, FakePublisher
from flywheel._cache import cache_key
from flywheel.safetensors import encode_header, read_file, read_header, write_state_dict

np = pytest.importorskip("numpy")

PUSH = "push-secret"
READ = "read-secret"
HERE = os.path.dirname(os.path.abspath(__file__))


def client_of(fake, token=PUSH, **kwargs):
    kwargs.setdefault("timeout", 10)
    return flywheel.Client(fake.url, token, client_name="test@host", **kwargs)


def hf_state_dict(seed=0, scale=1.0):
    """A small numpy state_dict with HF-style names."""
    rng = np.random.default_rng(seed)
    names = {"model.embed_tokens.weight": (64, 16), "model.norm.weight": (16,),
             "model.layers.0.mlp.up_proj.weight": (32, 16),
             "model.layers.0.mlp.down_proj.weight": (16, 32), "lm_head.weight": (64, 16)}
    return {name: (rng.standard_normal(shape) * scale).astype(np.float32)
            for name, shape in names.items()}


def bf16_words(array):
    """Reference bf16 conversion: round to nearest even on the upper 16 bits of f32."""
    words = []
    for bits in np.asarray(array, dtype=np.float32).reshape(-1).view(np.uint32).tolist():
        upper, lower = bits >> 16, bits & 0xFFFF
        if lower > 0x8000 or (lower == 0x8000 and upper & 1):
            upper += 1
        words.append(upper)
    return struct.pack(f"<{len(words)}H", *words)


def write_checkpoint(path, seed=0):
    write_state_dict(hf_state_dict(seed), str(path))
    return path.read_bytes()


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """FLYWHEEL_BIN = the fake flywheel; returns a function giving the calls it got."""
    log = tmp_path / "fake-flywheel.log"
    script = tmp_path / "flywheel"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE}/fake_flywheel.py \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FLYWHEEL_BIN", str(script))
    monkeypatch.setenv("FAKE_FLYWHEEL_LOG", str(log))

    def calls():
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]
    return calls


def flag(call, name):
    return call[call.index(name) + 1]


# ---------------------------------------------------------------------------------------
# safetensors writer


def test_state_dict_is_written_as_bf16_with_its_names_sorted_and_aligned(tmp_path):
    state = hf_state_dict()
    # Rounding cases: exact halfway rounds to even, above halfway rounds up.
    state["model.rounding"] = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F800000],
                                       dtype=np.uint32).view(np.float32)
    path = tmp_path / "model.safetensors"
    size = write_state_dict(state, str(path), metadata={"format": "pt"})
    raw = path.read_bytes()
    assert size == len(raw)
    (header_length,) = struct.unpack("<Q", raw[:8])
    assert (8 + header_length) % 8 == 0
    header_text = raw[8:8 + header_length]
    assert header_text.startswith(b"{") and header_text.rstrip(b" ").endswith(b"}")
    tensors, metadata = read_header(io.BytesIO(raw), len(raw))
    assert metadata == {"format": "pt"}
    assert [t.name for t in tensors] == sorted(state)
    loaded, _ = read_file(str(path))
    for name, array in state.items():
        dtype, shape, data = loaded[name]
        assert dtype == "BF16" and shape == array.shape, name
        assert data == bf16_words(array), name
    assert loaded["model.rounding"][2] == struct.pack("<4H", 0x3F80, 0x3F82, 0x3F81, 0x3F80)


def test_writer_refuses_integer_tensors_naming_them(tmp_path):
    with pytest.raises(flywheel.SafetensorsError, match="position_ids"):
        write_state_dict({"position_ids": np.arange(4)}, str(tmp_path / "x.safetensors"))


def test_reader_rejects_a_gap_between_tensors():
    header = encode_header([("a", "BF16", (2,), 4), ("b", "BF16", (2,), 4)])
    data = header + bytes(8)
    # Move b's offsets 2 bytes on: a gap after a and b past the end.
    broken = data.replace(b'"data_offsets":[4,8]', b'"data_offsets":[6,10]')
    assert broken != data
    with pytest.raises(flywheel.SafetensorsError, match="'b'"):
        read_header(io.BytesIO(broken), len(broken))


def test_torch_state_dict_matches_torch_bf16(tmp_path, fake):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)
    state = {"model.layers.0.mlp.up_proj.weight": layer.weight,
             "model.layers.0.mlp.up_proj.bias": layer.bias,
             "model.transposed": layer.weight.detach().t(),  # not contiguous
             "model.half": torch.randn(5, 3).half()}
    row = client_of(fake).push(state)
    body = fake.files[row["version"]]["model.safetensors"]
    path = tmp_path / "got.safetensors"
    path.write_bytes(body)
    loaded, _ = read_file(str(path))
    assert sorted(loaded) == sorted(state)
    for name, tensor in state.items():
        expected = tensor.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        dtype, shape, data = loaded[name]
        assert dtype == "BF16" and shape == tuple(tensor.shape), name
        assert data == expected.astype("<i2").tobytes(), name


# ---------------------------------------------------------------------------------------
# Full pushes


def test_push_file_uploads_its_bytes_with_bearer_token(tmp_path, fake):
    path = tmp_path / "step.safetensors"
    data = write_checkpoint(path)
    seen = []
    client = client_of(fake, part_size=1000)
    row = client.push(str(path), metadata={"step": 1, "loss": 0.5},
                      progress=lambda sent, total: seen.append((sent, total)))
    assert row["version"] == 1 and row["upload_kind"] == "full"
    assert row["metadata"] == {"step": 1, "loss": 0.5}
    assert row["pushed_by"]["client"] == "test@host"
    assert fake.files[1] == {"model.safetensors": data}
    create = json.loads(json.dumps(fake.rows[0]))  # the row, as the server recorded it
    assert create["uploaded_bytes"] == len(data)
    assert len(fake.requests_to("PUT", "/v1/uploads/")) == -(-len(data) // 1000)
    assert seen[-1] == (len(data), len(data))
    assert all(r.authorization == f"Bearer {PUSH}" for r in fake.requests)
    assert client.versions()["head_version"] == 1
    assert client.version(1)["weights_hash"] == row["weights_hash"]


def write_sharded(directory, seed=0):
    """A two-shard checkpoint directory; returns the shard names."""
    directory.mkdir()
    state = hf_state_dict(seed)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:2],
              "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        write_state_dict({n: state[n] for n in shard_names}, str(directory / shard))
        weight_map.update({n: shard for n in shard_names})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sorted(shards)


def test_push_sharded_directory_sends_shards_then_index(tmp_path, fake):
    directory = tmp_path / "ckpt"
    shards = write_sharded(directory)
    row = client_of(fake, part_size=777).push(directory, version=5)
    assert row["version"] == 5
    got = fake.files[5]
    assert list(got) == shards + ["model.safetensors.index.json"]
    for name, data in got.items():
        assert data == (directory / name).read_bytes(), name


def test_push_numpy_state_dict_and_wait(fake):
    fake.set_serving(100)  # every worker already serves anything up to v100
    row = client_of(fake).push(hf_state_dict(), wait=1.0)
    loaded = fake.files[row["version"]]["model.safetensors"]
    tensors, _ = read_header(io.BytesIO(loaded), len(loaded))
    assert {t.dtype for t in tensors} == {"BF16"}
    waits = fake.requests_to("GET", "/v1/wait")
    assert len(waits) == 1 and waits[0].query["version"] == str(row["version"])


@pytest.mark.parametrize("part", [1024, 256 << 10])  # the cut hits the answer / the send
def test_resume_after_a_cut_sends_only_the_missing_bytes(tmp_path, fake, part):
    path = tmp_path / "model.safetensors"
    state = hf_state_dict()
    state["model.big"] = np.ones((3 * part // 4, 2), dtype=np.float32)  # 3 parts of bf16
    write_state_dict(state, str(path))
    data = path.read_bytes()
    assert len(data) > 3 * part
    fake.cut_puts = {1: 1000}  # the second part is cut after 1000 of its bytes
    row = client_of(fake, part_size=part).push(path)
    assert fake.files[row["version"]]["model.safetensors"] == data
    puts = fake.requests_to("PUT", "/v1/uploads/")
    assert sum(p.body_bytes for p in puts) == len(data), "a byte was sent twice"
    assert [int(p.query["offset"]) for p in puts[:3]] == [0, part, part + 1000]
    assert len(fake.requests_to("GET", "/v1/uploads/")) == 1


def test_upload_gives_up_after_the_retries_and_aborts(tmp_path, fake):
    path = tmp_path / "model.safetensors"
    write_checkpoint(path)
    fake.cut_puts = {i: 10 for i in range(100)}
    with pytest.raises(flywheel.ConnectionFailed, match="gave up after 3 failed"):
        client_of(fake, part_size=4096, retries=2).push(path)
    assert len(fake.requests_to("DELETE", "/v1/uploads/")) == 1
    assert fake.uploads == {} and fake.rows == []


# ---------------------------------------------------------------------------------------
# Deltas and the push cache


def test_second_push_is_a_delta_from_the_cache(tmp_path, fake, fake_bin):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_checkpoint(first, seed=1)
    second_bytes = write_checkpoint(second, seed=2)
    client = client_of(fake)
    assert client.push(first)["upload_kind"] == "full"
    assert fake_bin() == []  # nothing cached yet: no delta
    cache_dir = tmp_path / "cache" / cache_key(fake.url)
    assert cache_key(fake.url) == hashlib.sha256(fake.url.encode()).hexdigest()[:16]
    assert (cache_dir / "model.safetensors").read_bytes() == first.read_bytes()
    assert json.loads((cache_dir / "last.json").read_text()) == {
        "url": fake.url, "version": 1, "weights_hash": fake.rows[0]["weights_hash"]}

    row = client.push(second, metadata={"step": 2})
    assert row["upload_kind"] == "delta" and row["version"] == 2
    (call,) = fake_bin()
    assert call[:2] == ["delta", "encode"]
    assert flag(call, "--base") == str(cache_dir / "model.safetensors")
    assert flag(call, "--target") == str(second)
    assert flag(call, "--base-version") == "1" and flag(call, "--target-version") == "2"
    body = fake.bodies[2]
    assert body.startswith(b"FAKEDELTA")
    assert json.loads(body[len(b"FAKEDELTA"):])["target_sha256"] == \
        hashlib.sha256(second_bytes).hexdigest()
    creates = [r for r in fake.requests_to("POST", "/v1/uploads") if r.path == "/v1/uploads"]
    assert len(creates) == 2
    assert (cache_dir / "model.safetensors").read_bytes() == second_bytes
    assert json.loads((cache_dir / "last.json").read_text())["version"] == 2
    assert sorted(os.listdir(tmp_path / "cache")) == sorted([cache_key(fake.url),
                                                             cache_key(fake.url) + ".lock"])


def test_sharded_checkpoints_are_cached_under_checkpoint(tmp_path, fake, fake_bin):
    client = client_of(fake)
    shards = write_sharded(tmp_path / "v1", seed=1)
    write_sharded(tmp_path / "v2", seed=2)
    client.push(tmp_path / "v1")
    cached = tmp_path / "cache" / cache_key(fake.url) / "checkpoint"
    assert sorted(os.listdir(cached)) == sorted(shards + ["model.safetensors.index.json"])
    assert (cached / shards[0]).read_bytes() == (tmp_path / "v1" / shards[0]).read_bytes()
    assert client.push(tmp_path / "v2")["upload_kind"] == "delta"
    (call,) = fake_bin()
    assert flag(call, "--base") == str(cached) and flag(call, "--target") == str(tmp_path / "v2")
    assert (cached / shards[1]).read_bytes() == (tmp_path / "v2" / shards[1]).read_bytes()


def test_unknown_base_falls_back_to_a_full_upload(tmp_path, fake, fake_bin):
    client = client_of(fake)
    client.push(hf_state_dict(seed=1))
    fake.unrebuildable = {1}
    row = client.push(hf_state_dict(seed=2), version=7)
    assert row["upload_kind"] == "full" and row["version"] == 7
    assert len(fake_bin()) == 1  # the delta was encoded, then refused
    assert flag(fake_bin()[0], "--target-version") == "7"
    loaded = fake.files[7]["model.safetensors"]
    expected = tmp_path / "expected.safetensors"
    write_state_dict(hf_state_dict(seed=2), str(expected), metadata={"format": "pt"})
    assert loaded == expected.read_bytes()
    last = json.loads((tmp_path / "cache" / cache_key(fake.url) / "last.json").read_text())
    assert last["version"] == 7


def test_failed_encoding_falls_back_to_a_full_upload(tmp_path, fake, fake_bin, monkeypatch):
    client = client_of(fake)
    client.push(hf_state_dict(seed=1))
    monkeypatch.setenv("FAKE_FLYWHEEL_FAIL", "1")
    row = client.push(hf_state_dict(seed=2))
    assert row["upload_kind"] == "full" and row["version"] == 2
    assert len(fake_bin()) == 1


def test_without_a_binary_no_cache_is_kept(tmp_path, fake):
    client_of(fake).push(hf_state_dict())
    assert not (tmp_path / "cache" / cache_key(fake.url)).exists()


# ---------------------------------------------------------------------------------------
# Errors


def test_version_conflict_carries_the_head(tmp_path, fake):
    client = client_of(fake)
    client.push(hf_state_dict(), version=3)
    with pytest.raises(flywheel.VersionConflict) as caught:
        client.push(hf_state_dict(seed=5), version=3)
    assert caught.value.status == 409 and caught.value.head_version == 3
    assert "not above the head v3" in caught.value.message


def test_tokens(fake):
    with pytest.raises(flywheel.Unauthorized) as caught:
        flywheel.Client(fake.url, "wrong", timeout=10).versions()
    assert caught.value.status == 401 and caught.value.code == "unauthorized"
    with pytest.raises(flywheel.Unauthorized):
        flywheel.Client(fake.url, None, timeout=10).status()
    reader = client_of(fake, token=READ)
    assert reader.status()["role"] == "publisher"
    with pytest.raises(flywheel.Forbidden) as caught:
        reader.push(hf_state_dict())
    assert caught.value.code == "forbidden" and not isinstance(caught.value, flywheel.PushDisabled)
    fake.push_token = None
    with pytest.raises(flywheel.PushDisabled):
        reader.pin(1)


def test_pin_blocks_pushes_and_unknown_versions(fake):
    client = client_of(fake)
    client.push(hf_state_dict(seed=1))
    client.push(hf_state_dict(seed=2))
    pinned = client.pin(1, metadata={"why": "regression"})
    assert pinned["version"] == 3 and pinned["pinned_to"] == 1
    assert pinned["weights_hash"] == client.version(1)["weights_hash"]
    with pytest.raises(flywheel.Pinned) as caught:
        client.push(hf_state_dict(seed=3))
    assert caught.value.pin["pinned_to"] == 1
    assert client.unpin() == {"pin": None, "head_version": 3}
    assert client.push(hf_state_dict(seed=3))["version"] == 4
    with pytest.raises(flywheel.NotFound, match="version 99"):
        client.version(99)
    with pytest.raises(flywheel.NotFound):
        client.pin(99)


def test_error_codes_map_to_classes_with_the_server_message(tmp_path, fake):
    client = client_of(fake)
    cases = [(422, "invalid_checkpoint", flywheel.InvalidCheckpoint),
             (422, "body_hash_mismatch", flywheel.BodyHashMismatch),
             (507, "insufficient_storage", flywheel.InsufficientStorage),
             (410, "upload_expired", flywheel.Expired)]
    for status, code, cls in cases:
        message = f"{code}: shard model.safetensors tensor 'x' at offset 8"
        fake.fail_next.append(("POST", "/v1/uploads/", ApiFailure(status, code, message)))
        with pytest.raises(cls) as caught:
            client.push(hf_state_dict())
        assert (caught.value.status, caught.value.code, caught.value.message) == \
            (status, code, message)
    fake.fail_next.append(("POST", "/v1/uploads", ApiFailure(
        422, "incomplete", "bytes are missing", missing=[[5, 9]])))
    with pytest.raises(flywheel.Incomplete) as caught:
        client.push(hf_state_dict())
    assert caught.value.missing == [[5, 9]]
    fake.max_upload_bytes = 100
    with pytest.raises(flywheel.TooLarge, match="100-byte limit"):
        client.push(hf_state_dict())
    assert fake.rows == []


def test_unknown_base_on_pin_carries_held_versions(fake):
    fake.fail_next.append(("POST", "/v1/pin", ApiFailure(
        409, "unknown_base", "cannot rebuild v1", held_versions=[4, 5])))
    with pytest.raises(flywheel.UnknownBase) as caught:
        client_of(fake).pin(1)
    assert caught.value.held_versions == [4, 5]


def test_unreachable_server_names_the_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(flywheel.ConnectionFailed, match=f"127.0.0.1:{port}/v1/versions") as caught:
        flywheel.Client(url, PUSH, timeout=5).versions()
    assert isinstance(caught.value, ConnectionError)


def test_https_is_verified_against_ca_file(tmp_path):
    openssl = shutil.which("openssl", path=os.defpath)  # PATH is emptied by clean_env
    if openssl is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=30)
    fake = FakePublisher().start(tls=(str(cert), str(key)))
    try:
        assert fake.url.startswith("https://")
        client = flywheel.Client(fake.url, PUSH, timeout=10, ca_file=str(cert))
        assert client.push(hf_state_dict())["version"] == 1
        with pytest.raises(flywheel.ConnectionFailed, match="TLS"):
            flywheel.Client(fake.url, PUSH, timeout=10).versions()  # system CAs only
    finally:
        fake.stop()


def _self_signed(openssl, tmp_path, name):
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=30)
    return str(cert), str(key)


def test_mutual_tls_presents_the_client_certificate(tmp_path):
    openssl = shutil.which("openssl", path=os.defpath)
    if openssl is None:
        pytest.skip("no openssl command to make a certificate")
    server_cert, server_key = _self_signed(openssl, tmp_path, "server")
    client_cert, client_key = _self_signed(openssl, tmp_path, "client")
    fake = FakePublisher().start(tls=(server_cert, server_key), client_ca=client_cert)
    try:
        client = flywheel.Client(fake.url, PUSH, timeout=10, ca_file=server_cert,
                                 cert_file=client_cert, key_file=client_key)
        assert client.push(hf_state_dict())["version"] == 1
        # Without a certificate the server refuses the handshake.
        with pytest.raises(flywheel.ConnectionFailed):
            flywheel.Client(fake.url, PUSH, timeout=10, ca_file=server_cert).versions()
    finally:
        fake.stop()
    with pytest.raises(ValueError, match="not https"):
        flywheel.Client("http://127.0.0.1:1", PUSH, cert_file=client_cert, key_file=client_key)


def test_the_token_may_come_from_the_environment(fake, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TOKEN", PUSH)
    assert flywheel.Client(fake.url, timeout=5).push(hf_state_dict())["version"] == 1
    monkeypatch.delenv("FLYWHEEL_TOKEN")
    with pytest.raises(flywheel.ApiError):
        flywheel.Client(fake.url, timeout=5).push(hf_state_dict())


# ---------------------------------------------------------------------------------------
# wait_serving


def serve_later(fake, version, delay):
    timer = threading.Timer(delay, fake.set_serving, args=(version,))
    timer.start()
    return timer


def test_wait_serving_returns_when_the_fleet_serves(fake):
    client = client_of(fake)
    client.push(hf_state_dict())
    serve_later(fake, 1, 0.3)
    started = time.monotonic()
    readiness = client.wait_serving(1, fraction=1.0, timeout=10)
    elapsed = time.monotonic() - started
    assert readiness["ready"] is True and readiness["serving"] == 2
    assert 0.25 <= elapsed < 5
    (request,) = fake.requests_to("GET", "/v1/wait")  # one long-poll, no polling
    assert request.query["min_workers"] == "1" and float(request.query["fraction"]) == 1.0


def test_wait_serving_times_out_with_the_last_readiness(fake):
    client = client_of(fake)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        client.wait_serving(1, fraction=0.5, timeout=1.0)
    elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 4
    assert isinstance(caught.value, flywheel.WaitTimeout)
    assert caught.value.readiness["serving"] == 0 and caught.value.readiness["workers"] == 2
    assert "0 of 2" in str(caught.value)
    assert len(fake.requests_to("GET", "/v1/wait")) <= 2


def test_wait_serving_reissues_a_capped_long_poll(fake):
    fake.wait_cap_ms = 200  # the server answers not-ready every 200 ms
    serve_later(fake, 1, 0.9)
    readiness = client_of(fake).wait_serving(1, timeout=10)
    assert readiness["ready"] is True
    assert 4 <= len(fake.requests_to("GET", "/v1/wait")) <= 8


def test_readiness_and_status(fake):
    client = client_of(fake, token=READ)
    assert client.readiness()["workers"] == 2
    assert client.readiness(3)["version"] == 3
    assert fake.requests_to("GET", "/v1/readiness")[-1].query == {"version": "3"}
