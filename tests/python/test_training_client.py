"""flywheel.TrainingClient / ServiceClient / SamplingClient against the in-process fakes of
the training service and of rollout workers (tests/python/fake_training.py): seq numbering
and order, the retry with the same seq, errors as exceptions, forward_backward_custom's two
calls (and the gap it fills when the loss fails), sampling round-robin and versions.

Run: /usr/bin/python3 -m pytest tests/python/test_training_client.py -q
"""

import threading
import time

import pytest

import flywheel
from fake_training import FakeTrainer, FakeWorker
from flywheel.training import Datum

np = pytest.importorskip("numpy")


@pytest.fixture
def trainer():
    fake = FakeTrainer().start()
    yield fake
    fake.stop()


@pytest.fixture
def workers():
    fakes = [FakeWorker(version=3).start(), FakeWorker(version=3).start()]
    yield fakes
    for fake in fakes:
        fake.stop()


def datums(count=2):
    return [Datum.from_prompt_completion([13, 1, 2, 12], [1, 2, 14], logprobs=[-1, -1, -1],
                                         advantage=0.5 * (i + 1)) for i in range(count)]


def calls_of(fake, session_id):
    return [(seq, call) for sid, seq, call in fake.ran if sid == session_id]


# ---------------------------------------------------------------------------------------
# Sessions and calls


def test_every_call_round_trips_with_its_seq(trainer):
    service = flywheel.ServiceClient(trainer.url)
    assert service.info().mode == "full"
    client = service.create_session(name="run-1")
    assert client.name == "run-1" and client.session_id == "s1"
    forward = client.forward(datums())
    assert [list(lp) for lp in forward.logprobs] == [
        pytest.approx([-0.02, -0.03, -0.13, -0.02, -0.03, -0.15])] * 2
    assert forward.routing is None
    metrics = client.forward_backward(datums(), loss="ppo", clip_low=0.2, tis_cap=2.0)
    assert metrics.loss == pytest.approx(6 * 0.5 + 6 * 1.0) and metrics["sequences"] == 2
    assert client.optim_step(lr=5e-5, grad_clip=1.0).grad_norm == 1.5
    weights = client.save_weights_for_sampler()
    assert weights.version == 1 and weights.adapter is None
    state = client.save_state("init")
    assert state.path == "sessions/s1/init" and state.step == 1
    assert client.load_state(state.path).id == "s1"
    info = client.get_info()
    assert info.step == 1 and info.saved_states == ["sessions/s1/init"]
    assert client.session_status().calls == 7
    assert calls_of(trainer, "s1") == [
        (1, "forward"), (2, "forward_backward"), (3, "optim_step"),
        (4, "save_weights_for_sampler"), (5, "save_state"), (6, "load_state"), (7, "get_info")]
    headers = dict(trainer.bodies)
    assert headers["forward_backward"] == {"lengths": [6, 6], "seq": 2, "loss": "ppo",
                                           "loss_config": {"clip_low": 0.2, "tis_cap": 2.0}}
    assert headers["optim_step"] == {"adam": {"lr": 5e-5, "grad_clip": 1.0}, "seq": 3}
    client.close()
    assert trainer.sessions == {}
    client.close()  # idempotent


def test_async_calls_run_in_the_order_they_were_made(trainer):
    trainer.delay["forward_backward"] = 0.05
    with flywheel.TrainingClient(trainer.url, max_in_flight=8) as client:
        futures = []
        for _ in range(5):
            futures.append(client.forward_backward_async(datums(), loss="ppo"))
            futures.append(client.optim_step_async(lr=1e-4))
        futures.append(client.save_weights_for_sampler_async())
        results = [f.result(timeout=30) for f in futures]
        assert [r.step for r in results[1:10:2]] == [1, 2, 3, 4, 5]
        assert results[-1].version == 1
        assert [seq for seq, _ in calls_of(trainer, client.session_id)] == list(range(1, 12))


def test_calls_from_many_threads_keep_their_seq_order(trainer):
    with flywheel.TrainingClient(trainer.url, max_in_flight=4) as client:
        threads = [threading.Thread(target=lambda: [client.get_info() for _ in range(5)])
                   for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [seq for seq, _ in calls_of(trainer, client.session_id)] == list(range(1, 21))


def test_a_lost_answer_is_retried_with_the_same_seq_and_not_run_twice(trainer):
    trainer.drop_answer.add(2)
    with flywheel.TrainingClient(trainer.url) as client:
        client.forward_backward(datums())
        metrics = client.optim_step(lr=1e-3)  # seq 2: runs, its answer is lost, asked again
        assert metrics.step == 1
        assert client.get_info().step == 1
        assert calls_of(trainer, client.session_id) == [
            (1, "forward_backward"), (2, "optim_step"), (3, "get_info")]


def test_server_errors_raise_with_the_servers_code_and_message(trainer):
    with flywheel.TrainingClient(trainer.url) as client:
        with pytest.raises(flywheel.BadRequest, match="unknown loss 'nope'") as caught:
            client.forward_backward(datums(), loss="nope")
        assert caught.value.status == 400 and caught.value.code == "bad_request"
        with pytest.raises(flywheel.NotFound, match="no saved state 'x'"):
            client.load_state("x")
        trainer.fail_call["optim_step"] = (413, "too_large", "batch over --max-batch-tokens")
        with pytest.raises(flywheel.TooLarge, match="max-batch-tokens"):
            client.optim_step()
        trainer.fail_call["optim_step"] = (500, "internal", "the trainer failed: NaN")
        with pytest.raises(flywheel.InternalError, match="NaN"):
            client.optim_step()
        del trainer.fail_call["optim_step"]
        assert client.get_info().calls == 4  # the session stays usable
        # A second session in full mode.
        with pytest.raises(flywheel.SessionConflict, match="owns the weights") as conflict:
            flywheel.TrainingClient(trainer.url)
        assert conflict.value.status == 409


def test_seq_timeout_and_seq_replayed_map_to_their_classes(trainer):
    trainer.seq_wait = 0.2
    with flywheel.TrainingClient(trainer.url) as client:
        client._next_seq = 3  # as if seq 1 and 2 were lost on the way
        with pytest.raises(flywheel.SeqTimeout, match="never arrived"):
            client.get_info()
    trainer.seq_wait = 5
    trainer.sessions.clear()
    with flywheel.TrainingClient(trainer.url) as client:
        client.get_info()
        session = trainer.sessions[client.session_id]
        session.answers.clear()  # as if seq 1 fell out of the last 64 answers
        client._next_seq = 1
        with pytest.raises(flywheel.SeqReplayed, match="too long ago"):
            client.get_info()
        client._next_seq = 2


def test_name_taken(trainer):
    trainer.mode = "lora"
    with flywheel.ServiceClient(trainer.url) as service:
        first = service.create_session(name="a")
        with pytest.raises(flywheel.NameTaken, match="'a' is in use"):
            service.create_session(name="a")
        assert first.save_weights_for_sampler().adapter == "a"
        first.close()


def test_too_many_sessions(trainer):
    trainer.mode = "lora"
    trainer.max_sessions_per_token = 1
    with flywheel.ServiceClient(trainer.url) as service:
        first = service.create_session(name="a")
        with pytest.raises(flywheel.TooManySessions, match="--max-sessions-per-token") as capped:
            service.create_session(name="b")
        assert capped.value.status == 409 and capped.value.code == "too_many_sessions"
        first.close()
        service.create_session(name="b").close()  # a closed session frees its place


def test_arguments_are_checked_before_a_seq_is_used(trainer):
    with flywheel.TrainingClient(trainer.url) as client:
        with pytest.raises(ValueError, match="unknown loss_config key"):
            client.forward_backward(datums(), loss="ppo", clipp=0.2)
        with pytest.raises(ValueError, match="finite number"):
            client.forward_backward(datums(), loss="ppo", tis_cap=float("nan"))
        with pytest.raises(ValueError, match="unknown AdamW"):
            client.optim_step(learning_rate=1)
        with pytest.raises(ValueError, match="given for some datums"):
            client.forward([Datum([1], [2], logprobs=[0.0]), Datum([1], [2])])
        client.get_info()
        assert calls_of(trainer, client.session_id) == [(1, "get_info")]


def test_attach_to_an_existing_session_numbers_after_its_calls(trainer):
    first = flywheel.TrainingClient(trainer.url)
    first.forward_backward(datums())
    first.optim_step()
    first.close(delete=False)
    again = flywheel.TrainingClient(trainer.url, session=first.session_id)
    assert again.get_info().step == 1
    assert calls_of(trainer, first.session_id)[-1] == (3, "get_info")
    again.close()


def test_unknown_session_is_not_found(trainer):
    with pytest.raises(flywheel.NotFound, match="unknown or expired session 'zz'"):
        flywheel.TrainingClient(trainer.url, session="zz")


def test_a_closed_client_refuses_calls(trainer):
    client = flywheel.TrainingClient(trainer.url)
    client.close()
    with pytest.raises(flywheel.FlywheelError, match="closed"):
        client.get_info()


def test_unreachable_server_is_connection_failed():
    with pytest.raises(flywheel.ConnectionFailed, match="127.0.0.1:9"):
        flywheel.TrainingClient("http://127.0.0.1:9", timeout=2)


# ---------------------------------------------------------------------------------------
# forward_backward_custom


def test_forward_backward_custom_sends_the_loss_and_grads(trainer):
    seen = {}

    def loss_fn(batch, logprobs):
        seen["datums"], seen["logprobs"] = batch, logprobs
        grads = [np.full(len(lp), -0.25, dtype=np.float32) for lp in logprobs]
        return 1.75, grads

    with flywheel.TrainingClient(trainer.url) as client:
        batch = datums(3)
        metrics = client.forward_backward_custom(batch, loss_fn)
        assert metrics.loss == 1.75 and metrics.sequences == 3
        assert seen["datums"] == batch
        assert [lp.dtype for lp in seen["logprobs"]] == [np.float32] * 3
        assert trainer.grads == [[-0.25] * 18]
        assert calls_of(trainer, client.session_id) == [(1, "forward"),
                                                        (2, "forward_backward_custom")]
        headers = [h for call, h in trainer.bodies if call == "forward_backward_custom"]
        assert headers == [{"lengths": [6, 6, 6], "seq": 2, "loss_value": 1.75}]


def test_forward_backward_custom_keeps_order_with_later_async_calls(trainer):
    def slow_loss(batch, logprobs):
        time.sleep(0.1)  # later calls arrive at the server meanwhile and wait for seq 2
        return 0.5, [np.zeros(len(lp)) + 1 for lp in logprobs]

    with flywheel.TrainingClient(trainer.url, max_in_flight=2) as client:
        custom = client.forward_backward_custom_async(datums(), slow_loss)
        step = client.optim_step_async(lr=1e-3)
        info = client.get_info_async()
        assert custom.result(timeout=30).loss == 0.5
        assert step.result(timeout=30).step == 1 and info.result(timeout=30).step == 1
        assert calls_of(trainer, client.session_id) == [
            (1, "forward"), (2, "forward_backward_custom"), (3, "optim_step"), (4, "get_info")]


@pytest.mark.parametrize("loss_fn, error, message", [
    (lambda b, lps: (_ for _ in ()).throw(RuntimeError("my loss broke")), RuntimeError,
     "my loss broke"),
    (lambda b, lps: (float("nan"), [np.zeros(len(lp)) for lp in lps]), ValueError, "not finite"),
    (lambda b, lps: (1.0, [np.zeros(len(lp) + 1) for lp in lps]), ValueError, "gradient 0 has 7"),
    (lambda b, lps: (1.0, [np.zeros(len(lps[0]))]), ValueError, "1 gradients for 2 datums"),
    (lambda b, lps: (1.0, [np.full(len(lp), np.inf) for lp in lps]), ValueError, "not finite"),
    (lambda b, lps: 1.0, TypeError, "must return \\(loss_value, grads\\)"),
])
def test_a_failing_loss_fn_raises_and_fills_its_seq(trainer, loss_fn, error, message):
    with flywheel.TrainingClient(trainer.url) as client:
        later = None
        with pytest.raises(error, match=message):
            future = client.forward_backward_custom_async(datums(), loss_fn)
            later = client.optim_step_async(lr=1e-3)  # must not wait for a seq that never comes
            future.result(timeout=30)
        assert later.result(timeout=30).step == 1
        assert calls_of(trainer, client.session_id) == [
            (1, "forward"), (2, "get_info"), (3, "optim_step")]
        assert trainer.grads == []


def test_forward_backward_custom_with_a_torch_loss(trainer):
    torch = pytest.importorskip("torch")

    def reinforce(batch, logprobs):
        return -sum((lp * torch.tensor(np.asarray(d.advantages))).sum()
                    for d, lp in zip(batch, logprobs))

    with flywheel.TrainingClient(trainer.url) as client:
        metrics = client.forward_backward_custom(datums(), flywheel.torch_loss_fn(reinforce))
        # logprob of target y is -0.01 (y + 1): targets [1, 2, 12, 1, 2, 14]
        expected = (0.5 + 1.0) * 0.01 * (2 + 3 + 13 + 2 + 3 + 15)
        assert metrics.loss == pytest.approx(expected, rel=1e-6)
        assert trainer.grads[0] == pytest.approx([-0.5] * 6 + [-1.0] * 6)


# ---------------------------------------------------------------------------------------
# Sampling


def test_sample_round_robin_and_fields(workers):
    with flywheel.SamplingClient(",".join(w.url for w in workers)) as sampler:
        first = sampler.sample([13, 3, 1, 2, 12], n=3, max_tokens=7, temperature=0.5, seed=7,
                               stop_token_ids=[12])
        second = sampler.sample([13, 5, 12], n=1, max_tokens=7, logprobs=False)
        assert len(first) == 3 and len(second) == 1
        sample = first[0]
        assert sample.prompt_tokens == [13, 3, 1, 2, 12]
        assert sample.tokens == [12, 2, 1, 3, 13, 14] and sample.finish_reason == "stop"
        assert sample.logprobs == [-0.5] * 6 and sample.policy_versions == [3] * 6
        assert sample.version == 3 and sample.routing is None
        assert second[0].logprobs is None
        assert [len(w.requests) for w in workers] == [1, 1]
        assert workers[0].requests[0] == {"prompt": [13, 3, 1, 2, 12], "n": 3, "max_tokens": 7,
                                          "temperature": 0.5, "stop_token_ids": [12], "seed": 7,
                                          "logprobs": True}
        datum = sample.to_datum(advantage=1.0)
        assert list(datum.tokens) == [13, 3, 1, 2, 12, 12, 2, 1, 3, 13]
        assert list(datum.weights) == [0] * 4 + [1] * 6
        assert list(datum.policy_versions) == [3] * 10


def test_sample_routing_is_decoded_to_expert_ids(workers):
    with flywheel.SamplingClient([workers[0].url]) as sampler:
        (sample,) = sampler.sample([13, 5, 12], max_tokens=4, return_routing=True)
        rows = 3 + len(sample.tokens) - 1
        assert sample.routing == [1, 258] * rows and sample.routing_shape == [rows, 1, 2]
        assert len(sample.to_datum(0.0).routing) == rows * 2


def test_sample_async_futures(workers):
    with flywheel.SamplingClient([w.url for w in workers]) as sampler:
        futures = [sampler.sample_async([13, i, 12], n=2, max_tokens=5) for i in range(8)]
        results = [f.result(timeout=30) for f in futures]
        assert [r[0].tokens[1] for r in results] == list(range(8))
        assert sorted(len(w.requests) for w in workers) == [4, 4]


def test_an_unreachable_worker_is_skipped(workers):
    with flywheel.SamplingClient(["http://127.0.0.1:9", workers[0].url], timeout=2) as sampler:
        for _ in range(3):
            assert sampler.sample([13, 1, 12], max_tokens=3)[0].worker == workers[0].url


def test_worker_errors_raise_with_their_message(workers):
    workers[0].fail_with = (400, {"error": {"message": "max_tokens must be >= 1, got 0",
                                            "type": "invalid_request_error"}})
    with flywheel.SamplingClient([workers[0].url]) as sampler:
        with pytest.raises(flywheel.BadRequest, match="max_tokens must be >= 1") as caught:
            sampler.sample([13, 1, 12], max_tokens=0)
        assert caught.value.code == "invalid_request_error"


def test_min_version_waits_for_a_worker_that_serves_it(workers):
    workers[0].version = 4
    workers[1].version = 3
    timer = threading.Timer(0.3, lambda: setattr(workers[1], "version", 5))
    timer.start()
    try:
        with flywheel.SamplingClient([w.url for w in workers]) as sampler:
            results = [sampler.sample([13, 1, 12], max_tokens=3, min_version=4) for _ in range(4)]
        assert all(s.version >= 4 for r in results for s in r)
        assert any(s.version == 5 for r in results for s in r)
    finally:
        timer.cancel()


def test_min_version_gives_up_after_its_timeout(workers):
    with flywheel.SamplingClient([workers[0].url]) as sampler:
        with pytest.raises(flywheel.StaleSample, match="v4 or later") as caught:
            sampler.sample([13, 1, 12], max_tokens=3, min_version=4, version_timeout=0.3)
        assert caught.value.versions == {workers[0].url: 3}


def test_wait_for_version(workers):
    with flywheel.SamplingClient([w.url for w in workers]) as sampler:
        assert sampler.wait_for_version(3, timeout=1) == {workers[0].url: 3, workers[1].url: 3}
        threading.Timer(0.2, lambda: setattr(workers[0], "version", 4)).start()
        versions = sampler.wait_for_version(4, timeout=5, all_workers=False)
        assert versions[workers[0].url] == 4
        with pytest.raises(flywheel.WaitTimeout, match="version 4 not served by every worker"):
            sampler.wait_for_version(4, timeout=0.2)


def test_wait_for_an_adapter_needs_it_listed(workers):
    with flywheel.SamplingClient([workers[0].url], adapter="sort-rl") as sampler:
        with pytest.raises(flywheel.WaitTimeout, match="of adapter sort-rl"):
            sampler.wait_for_version(1, timeout=0.2)
        workers[0].adapters.append("sort-rl")
        assert sampler.wait_for_version(1, timeout=2) == {workers[0].url: 3}
        sampler.sample([13, 1, 12], max_tokens=3)
        assert workers[0].requests[-1]["adapter"] == "sort-rl"
