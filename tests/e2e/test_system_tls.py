"""The whole system over TLS: router + prefill + decode as real processes, mTLS on the public port,
on the workers' internal service and on the KV-transfer control plane between the workers, with a
throwaway CA made at test time (tests/tls_pki.py). Real gRPC on loopback, real NIXL between workers.

The prefill worker takes `[internal_tls]` from its config file, the decode worker the same settings
as `--tls-*` flags, the router `[tls]`/`[internal_tls]` from its `--config`: every path is used.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from system_rig import greedy_reference, router_args, rpc_code, start_workers, wait_idle, worker_load
from tls_pki import TLSFiles

from cedserve.client import CedserveError, Client
from cedserve.common.tls import TLSConfig
from cedserve.kv_transfer.control import ControlClient
from cedserve.launcher import LocalLauncher, Part
from cedserve.model.checkpoint_writer import write_random_checkpoint
from cedserve.model.presets import preset

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class TLSSystem:
    def __init__(self, root: Path, files: TLSFiles) -> None:
        self.files = files
        self.checkpoint = root / "ckpt"
        write_random_checkpoint(preset("tiny"), self.checkpoint, seed=21)
        self.launcher = LocalLauncher(root / "logs")
        # The plane's identity: one certificate (serverAuth + clientAuth) every worker and the router use.
        self.plane = TLSConfig(cert=files.server_cert, key=files.server_key, ca=files.ca, require_client_cert=True)
        table = (f'[internal_tls]\ncert = "{files.server_cert}"\nkey = "{files.server_key}"\n'
                 f'ca = "{files.ca}"\nrequire_client_cert = true\n')
        flags = ["--tls-cert", files.server_cert, "--tls-key", files.server_key, "--tls-ca", files.ca,
                 "--tls-require-client-cert"]
        self.workers: dict[str, Part] = start_workers(
            self.launcher, self.checkpoint, {"prefill0": "prefill", "decode0": "decode"},
            extra_config={"prefill0": table}, extra_args={"decode0": flags})
        router_config = root / "router.toml"
        router_config.write_text(f'[tls]\ncert = "{files.server_cert}"\nkey = "{files.server_key}"\n'
                                 f'ca = "{files.ca}"\nrequire_client_cert = true\n' + table)
        ready = self.launcher.start("router", [*router_args(self.checkpoint, self.workers),
                                               "--config", str(router_config)])
        self.address = str(ready["address"])
        self.client_tls = TLSConfig(ca=files.ca, cert=files.client_cert, key=files.client_key)


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, tls_files: TLSFiles) -> Iterator[TLSSystem]:
    s = TLSSystem(tmp_path_factory.mktemp("tls-system"), tls_files)
    yield s
    s.launcher.stop_all()


def test_generate_over_mtls_equals_the_monolithic_model(system: TLSSystem) -> None:
    # 300 tokens: past the decode-only threshold, so the prefill worker handshakes with the decode
    # worker over the TLS control plane and WRITEs the KV over NIXL.
    prompt = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    with Client(system.address, timeout_s=120, tls=system.client_tls) as client:
        done = client.generate(prompt, max_tokens=6)
    assert done.finish_reason == "length"
    assert done.token_ids == greedy_reference(system.checkpoint, prompt, 6)
    loads = wait_idle(list(system.workers.values()), system.plane)
    assert all(x.held_blocks == 0 for x in loads.values()), loads


def test_cli_generate_with_tls_flags(system: TLSSystem) -> None:
    f = system.files
    out = subprocess.run([sys.executable, "-m", "cedserve.cli", "generate", "hello", "--address", system.address,
                          "--max-tokens", "3", "--tls-ca", f.ca, "--tls-cert", f.client_cert, "--tls-key",
                          f.client_key, "-v"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"completion_tokens": 3' in out.stderr


@pytest.mark.parametrize("what", ["plaintext", "no CA", "no client certificate"])
def test_public_port_refuses_clients_it_cannot_trust(system: TLSSystem, what: str) -> None:
    f = system.files
    tls = {"plaintext": None, "no CA": TLSConfig(cert=f.client_cert, key=f.client_key),
           "no client certificate": TLSConfig(ca=f.ca)}[what]
    with Client(system.address, timeout_s=10, tls=tls) as client, pytest.raises(CedserveError) as info:
        client.generate("hello", max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_worker_plane_refuses_plaintext_and_unauthenticated_peers(system: TLSSystem) -> None:
    f = system.files
    for part in system.workers.values():
        assert worker_load(part, system.plane).total_blocks > 0  # the plane's identity is served
        for tls in (TLSConfig(), TLSConfig(ca=f.ca)):  # plaintext; TLS without a client certificate
            assert rpc_code(lambda p=part, t=tls: worker_load(p, t)) == grpc.StatusCode.UNAVAILABLE
    # The KV-transfer control plane of the decode worker: the same certificates, the same refusals.
    token = (system.launcher.log_dir / "run" / "kv_transfer.token").read_text().strip()
    control = str(system.workers["decode0"].ready["control_address"])
    for tls, code in ((system.plane, grpc.StatusCode.OK), (TLSConfig(), grpc.StatusCode.UNAVAILABLE),
                      (TLSConfig(ca=f.ca), grpc.StatusCode.UNAVAILABLE)):
        client = ControlClient(control, token, tls)
        assert rpc_code(lambda c=client: c.heartbeat("probe", 1, timeout_s=5)) == code
        client.close()


def test_link_probe_between_running_workers_over_mtls(system: TLSSystem, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`cedserve bench kv-transfer --prefill-address --decode-address` (the helm test) over the internal
    plane's mTLS: the CLI to the prefill worker, and the prefill worker to the decode worker."""
    from cedserve.cli import main as cli_main

    f = system.files
    token = system.launcher.log_dir / "run" / "kv_transfer.token"
    base = ["bench", "kv-transfer", f"--prefill-address={system.workers['prefill0'].ready['address']}",
            f"--decode-address={system.workers['decode0'].ready['address']}", "--size-mib=0.1", "--iterations=1",
            f"--token-file={token}", "--timeout-s=60", f"--tls-ca={f.ca}", "--tls-server-name=cedserve-internal"]
    assert cli_main([*base, f"--tls-cert={f.server_cert}", f"--tls-key={f.server_key}"]) == 0
    assert "OK: 1 x 0.1 MiB verified" in capsys.readouterr().out
    assert cli_main(base) == 1  # no client certificate: the worker's mTLS listener refuses the CLI
    assert "UNAVAILABLE" in capsys.readouterr().err
    loads = wait_idle(list(system.workers.values()), system.plane)
    assert all(x.held_blocks == 0 for x in loads.values()), loads
