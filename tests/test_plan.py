"""The resource plan (plan.py) for this machine and for described GPU machines, without GPUs; and the plan's
devices reaching each replica's workers."""

from __future__ import annotations

import pytest
import torch

from embed_service.config import Settings
from embed_service.engine.engine import Engine
from embed_service.models.spec import load_spec
from embed_service.plan import GIB, Machine, ModelPlan, ModelRequest, PlanError, plan_resources
from embed_service.workers.device import rank_device

MINILM_BYTES = 90_000_000  # the packaged all-MiniLM-L6-v2's safetensors, about 87 MiB
TWO_CORES = Machine(cores=2, gpus=0, memory=24 * GIB)  # this machine
EIGHT_GPUS = Machine(cores=64, gpus=8, memory=512 * GIB)


def test_one_model_alone_on_two_cores_gets_two_single_thread_replicas():
    (m,) = plan_resources([ModelRequest("mini", "cpu", weight_bytes=MINILM_BYTES)], TWO_CORES).models
    assert (m.replicas, m.num_threads, m.devices) == (2, 1, (("cpu",), ("cpu",)))


def test_two_models_on_two_cores_get_one_replica_and_one_thread_each():
    plan = plan_resources(
        [
            ModelRequest("mini", "cpu", weight_bytes=MINILM_BYTES),
            ModelRequest("tiny", "cpu", weight_bytes=1_000_000),
        ],
        TWO_CORES,
    )
    assert [(m.name, m.replicas, m.num_threads) for m in plan.models] == [("mini", 1, 1), ("tiny", 1, 1)]
    assert plan.threads == 2 and plan.gpus_used == 0
    print("\n" + "\n".join(plan.lines()))


def test_spare_cores_go_to_the_first_models_workers_and_given_threads_are_kept():
    # 8 cores, 3 + 2 workers: 1 thread each leaves 3 cores, enough for the first model's 3 workers.
    plan = plan_resources(
        [ModelRequest("a", "cpu", replicas=3), ModelRequest("b", "cpu", replicas=2)], Machine(cores=8)
    )
    assert [m.num_threads for m in plan.models] == [2, 1] and plan.threads == 8
    # A model's own --num-threads is taken from the cores first; the others share what is left.
    plan = plan_resources(
        [ModelRequest("a", "cpu", replicas=1, num_threads=6), ModelRequest("b", "cpu", replicas=2)],
        Machine(cores=8),
    )
    assert [m.num_threads for m in plan.models] == [6, 1]


def test_more_threads_than_cores_are_planned_with_a_warning():
    plan = plan_resources([ModelRequest("a", "cpu", replicas=2, num_threads=4)], TWO_CORES)
    assert plan.threads == 8
    assert any("warning: 8 threads on 2 cores" in line for line in plan.lines())


def test_eight_gpus_two_models_each_replica_on_its_own_devices():
    plan = plan_resources(
        [
            ModelRequest("model-a", "cuda", tensor_parallel_size=2, replicas=2),
            ModelRequest("model-b", "cuda", tensor_parallel_size=1, replicas=4),
        ],
        EIGHT_GPUS,
    )
    a, b = plan.models
    assert a.devices == (("cuda:0", "cuda:1"), ("cuda:2", "cuda:3"))
    assert b.devices == (("cuda:4",), ("cuda:5",), ("cuda:6",), ("cuda:7",))
    every = [d for m in plan.models for replica in m.devices for d in replica]
    assert len(every) == len(set(every)) == 8  # no device shared
    assert (a.num_threads, b.num_threads, plan.threads) == (8, 8, 64)
    print("\n" + "\n".join(plan.lines()))


def test_nine_gpus_on_eight_are_refused_naming_what_each_model_needs():
    with pytest.raises(PlanError) as refused:
        plan_resources(
            [
                ModelRequest("model-a", "cuda", tensor_parallel_size=2, replicas=2),
                ModelRequest("model-b", "cuda", tensor_parallel_size=1, replicas=5),
            ],
            EIGHT_GPUS,
        )
    message = str(refused.value)
    assert "need 9 GPUs" in message and "8 visible" in message
    assert "model-a 2 replicas x tensor-parallel 2 = 4" in message
    assert "model-b 5 replicas x tensor-parallel 1 = 5" in message
    print(f"\nrefused: {message}")


def test_one_model_replicas_no_longer_share_the_first_gpus():
    # Before the plan every replica at --device cuda ran on cuda:0..tp-1.
    (m,) = plan_resources(
        [ModelRequest("m", "cuda", tensor_parallel_size=2, replicas=2)], Machine(cores=16, gpus=4)
    ).models
    assert m.devices == (("cuda:0", "cuda:1"), ("cuda:2", "cuda:3"))
    with pytest.raises(PlanError, match="need 4 GPUs .* 2 visible"):
        plan_resources([ModelRequest("m", "cuda", tensor_parallel_size=2, replicas=2)], Machine(16, gpus=2))


def test_a_cpu_model_beside_a_cuda_model_takes_no_gpu():
    plan = plan_resources(
        [ModelRequest("gpu", "cuda", replicas=1), ModelRequest("cpu", "cpu", replicas=1)], Machine(4, gpus=1)
    )
    assert [m.devices for m in plan.models] == [(("cuda:0",),), (("cpu",),)]
    assert plan.gpus_used == 1


def test_rank_device_takes_the_plans_device():
    assert rank_device("cuda", ("cuda:2", "cuda:3"), 1) == torch.device("cuda", 3)
    assert rank_device("cuda", (), 1) == torch.device("cuda", 1)  # no plan: as before
    assert rank_device("cpu", (), 0) == torch.device("cpu")


def test_each_replica_group_gets_its_own_devices(default_model_path):
    """The engine hands replica r's devices to its worker group (no worker is started)."""
    share = ModelPlan("m", "cuda", 2, 2, 4, (("cuda:4", "cuda:5"), ("cuda:6", "cuda:7")))
    settings = Settings(dtype="float32", tensor_parallel_size=2, data_parallel_size=2)
    engine = Engine(settings, load_spec(default_model_path, None), ["m"], share)
    groups = [engine._make_group(r, lambda reason: None) for r in range(2)]
    assert [g.cfg.devices for g in groups] == [("cuda:4", "cuda:5"), ("cuda:6", "cuda:7")]
    assert {g.cfg.device for g in groups} == {"cuda"} and engine.num_threads == 4
    assert groups[0].cfg.dist_port != groups[1].cfg.dist_port


H200 = 141 * GIB  # an H200's memory, as torch reports it (about 139.8 GiB usable)


def test_an_embedder_and_a_reranker_share_one_gpu_when_their_checkpoints_fit():
    """Was: refused ("need 2 GPUs, 1 visible"): every replica took a GPU of its own."""
    plan = plan_resources(
        [
            ModelRequest("bge-m3", "cuda", replicas=1, weight_bytes=2_270_000_000),
            ModelRequest("bge-reranker-v2-m3", "cuda", replicas=1, weight_bytes=2_270_000_000),
        ],
        Machine(cores=16, gpus=1, memory=128 * GIB, gpu_memory=H200),
    )
    assert [m.devices for m in plan.models] == [(("cuda:0",),), (("cuda:0",),)]
    assert plan.gpus_used == 1 and plan.shared_gpus() == {"cuda:0": ["bge-m3", "bge-reranker-v2-m3"]}
    assert "  cuda:0 shared by bge-m3, bge-reranker-v2-m3" in plan.lines()
    print("\n" + "\n".join(plan.lines()))


def test_gpus_are_shared_only_within_half_their_memory_and_only_when_it_is_known():
    two_7b = [ModelRequest(n, "cuda", replicas=1, weight_bytes=15 * GIB) for n in ("a", "b")]
    with pytest.raises(PlanError, match=r"b's replica 0 \(15.0 GiB checkpoint\) does not fit on any GPU"):
        plan_resources(two_7b, Machine(cores=16, gpus=1, gpu_memory=40 * GIB))  # 20 GiB for checkpoints
    (a, b) = plan_resources(two_7b, Machine(cores=16, gpus=1, gpu_memory=80 * GIB)).models
    assert a.devices == b.devices == (("cuda:0",),)
    with pytest.raises(PlanError, match="the GPUs' memory is unknown"):
        plan_resources(two_7b, Machine(cores=16, gpus=1))
    # Never two replicas of one model on a GPU: that is still a GPU each.
    with pytest.raises(
        PlanError, match="a's replica 1 .* does not fit on any GPU without another of its replicas"
    ):
        plan_resources(
            [ModelRequest("a", "cuda", replicas=2, weight_bytes=GIB)], Machine(16, 1, gpu_memory=H200)
        )
    # Tensor-parallel ranks never share.
    with pytest.raises(PlanError, match="the tensor-parallel replicas alone need 4"):
        plan_resources([ModelRequest("m", "cuda", 2, replicas=2)], Machine(16, gpus=2, gpu_memory=H200))
    # Enough GPUs: one each, as before, however much memory there is.
    plan = plan_resources(two_7b, Machine(cores=16, gpus=2, gpu_memory=H200))
    assert [m.devices for m in plan.models] == [(("cuda:0",),), (("cuda:1",),)] and not plan.shared_gpus()


def test_tensor_parallel_replicas_keep_their_gpus_and_the_others_share_the_rest():
    plan = plan_resources(
        [
            ModelRequest("big", "cuda", tensor_parallel_size=2, replicas=1, weight_bytes=30 * GIB),
            ModelRequest("embedder", "cuda", replicas=2, weight_bytes=GIB),
            ModelRequest("reranker", "cuda", replicas=1, weight_bytes=GIB),
        ],
        Machine(cores=32, gpus=4, gpu_memory=80 * GIB),
    )
    big, embedder, reranker = plan.models
    assert big.devices == (("cuda:0", "cuda:1"),)
    assert embedder.devices == (("cuda:2",), ("cuda:3",)) and reranker.devices == (("cuda:2",),)
    assert plan.gpus_used == 4


def test_front_ends_keep_a_core_each_and_tokenizer_threads_are_counted():
    """Was: --http-processes 4 on 16 cores gave the workers all 16 cores (8 threads each), the front ends
    none, and the plan said nothing of either."""
    model = [ModelRequest("mini", "cpu", replicas=2, weight_bytes=MINILM_BYTES)]
    alone = plan_resources(model, Machine(cores=16))
    assert alone.models[0].num_threads == 8 and alone.tokenizer_threads == 2  # one process, 2 threads
    plan = plan_resources(model, Machine(cores=16), frontends=4)
    assert plan.models[0].num_threads == 6 and plan.threads == 12 and plan.frontend_cores == 4
    assert plan.tokenizer_threads == 2 * 5  # the engine process's and each front end's
    assert plan.lines()[-1].endswith("; 4 HTTP processes (4 cores kept for them); 10 tokenization threads")
    info = plan.info()
    assert (info["http_processes"], info["frontend_cores"], info["tokenizer_threads"]) == (4, 4, 10)
    # Two cores, two workers, two front ends: no core to keep; planned, with a warning.
    plan = plan_resources(model, TWO_CORES, frontends=2)
    assert plan.models[0].num_threads == 1 and plan.frontend_cores == 0
    assert "  warning: 2 threads and 2 HTTP processes on 2 cores" in plan.lines()[-1]
    print("\n" + "\n".join(plan.lines()))
