"""`--local-ranks`: each local rank's flags, its command line (parsed back by the real parser) and its GPU."""

from __future__ import annotations

import dataclasses

import pytest

from cedserve.cli import build_parser
from cedserve.local_ranks import child_env, local_rank_options, worker_argv
from cedserve.serving.worker import WorkerOptions

pytestmark = pytest.mark.unit

POD = WorkerOptions(role="decode", config="/etc/cedserve/decode.toml", checkpoint="/models/ckpt", host="0.0.0.0",
                    grpc_port=50061, nixl_port=5600, metrics_port=9091, dist_port=29500, advertise_host="10.0.0.7",
                    group_size=4, rank=2, leader_address="ced-decode-0-0.ced", worker_id="ced-decode-0-2",
                    health_port=-1, tls_ca="/tls/ca.crt", tls_require_client_cert=True)


def test_local_rank_i_of_pod_r_is_group_rank_r_n_plus_i_on_the_pods_ports_plus_i() -> None:
    got = [local_rank_options(POD, 8, i) for i in range(8)]
    assert [o.rank for o in got] == list(range(16, 24)) and {o.group_size for o in got} == {32}
    assert [o.grpc_port for o in got] == list(range(50061, 50069))
    assert [o.nixl_port for o in got] == list(range(5600, 5608))
    assert [o.metrics_port for o in got] == list(range(9091, 9099))
    assert {o.health_port for o in got} == {-1} and {o.dist_port for o in got} == {29500}  # off stays off
    assert {o.leader_address for o in got} == {"ced-decode-0-0.ced"}
    one_pod = local_rank_options(dataclasses.replace(POD, group_size=1, rank=0, leader_address=None,
                                                     grpc_port=0), 2, 1)
    assert (one_pod.rank, one_pod.group_size, one_pod.leader_address, one_pod.grpc_port) == (1, 2, "127.0.0.1", 0)
    with pytest.raises(ValueError, match="only decode"):
        local_rank_options(dataclasses.replace(POD, role="prefill"), 2, 0)


def test_worker_argv_parses_back_to_the_same_options() -> None:
    for opts in (POD, local_rank_options(POD, 8, 5), WorkerOptions(role="decode")):
        args = build_parser().parse_args(worker_argv(opts))
        fields = {k: v for k, v in vars(args).items() if k in WorkerOptions.__dataclass_fields__}
        assert WorkerOptions(**fields) == opts


def test_each_local_rank_sees_one_of_the_pods_gpus() -> None:
    assert child_env(1, {"CUDA_VISIBLE_DEVICES": "4,5,6"})["CUDA_VISIBLE_DEVICES"] == "5"
    assert child_env(3, {})["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(ValueError, match="no GPU"):
        child_env(3, {"CUDA_VISIBLE_DEVICES": "0,1"})
