"""``python -m my_utils env``: devices, versions, the accelerate config in use and the relevant variables."""

import json
import subprocess
import sys

import pytest

from my_utils import UserError
from my_utils.tools import env


def test_tables_show_devices_versions_and_config(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env.main(["--config", str(env.Path(__file__).parent.parent / "configs" / "cpu_x2.yaml")])
    out = capsys.readouterr().out
    assert out.startswith("device  name")
    assert "torch         2.13.0" in out and "torch build" in out
    assert "distributed_type   MULTI_GPU" in out and "use_cpu            True" in out
    assert "OMP_NUM_THREADS  1" in out


def test_default_config_is_found_through_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_CONFIG_FILE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert env.accelerate_default_config() is None
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text("distributed_type: MULTI_CPU\nnum_processes: 4\n")
    info = env.environment()
    assert info["accelerate_config"]["settings"] == {"distributed_type": "MULTI_CPU", "num_processes": 4}
    assert "num_processes     4" in env.render(info)


def test_bad_config_files_are_one_sentence(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        env.read_accelerate_config(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(UserError, match="not valid YAML"):
        env.read_accelerate_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(UserError, match="not a mapping"):
        env.read_accelerate_config(tmp_path / "list.yaml")


@pytest.mark.slow
def test_json_output(subprocess_env):
    out = subprocess.run([sys.executable, "-m", "my_utils", "env", "--json"], env=subprocess_env,
                         capture_output=True, text=True, check=True).stdout
    info = json.loads(out)
    assert info["devices"][0]["kind"] == "cpu" and info["devices"][0]["total_memory"] > 0
    assert info["versions"]["torch"].startswith("2.13.0")
    assert info["environment"]["OMP_NUM_THREADS"] == "1"


def _machines(ip, port=29500, **more):
    return {"num_machines": 2, "main_process_ip": ip, "main_process_port": port, **more}


@pytest.mark.parametrize("settings, rank, message", [
    (_machines("10.0.0.1"), 0, "10.0.0.1 in x.yaml is not an address of this machine"),  # the shipped placeholder
    (_machines("machine-0.invalid"), 1, r"is not an address \(it does not resolve\)"),
    (_machines(None), 1, "sets no main_process_ip"),
    (_machines("127.0.0.1"), 2, "--machine-rank must be from 0 to 1"),
    (_machines("127.0.0.1"), 1, "is a loopback address, which every machine takes for itself"),
    ({"num_machines": 1}, 0, "is a config for one machine"),
    (_machines("0.0.0.0"), 0, "is an unspecified, broadcast or multicast address"),  # binds here, reaches nothing
    (_machines("0.0.0.0"), 1, "is an unspecified, broadcast or multicast address"),
    (_machines("255.255.255.255"), 1, "is an unspecified, broadcast or multicast address"),
])
def test_a_rendezvous_that_cannot_work_is_one_sentence(settings, rank, message):
    with pytest.raises(UserError, match=message):
        env.check_rendezvous("x.yaml", settings, rank)


def test_the_rendezvous_is_checked_from_both_ends(monkeypatch):
    import socket

    # machine 0 is played on this machine: its loopback address stands for a network address here
    monkeypatch.setattr(env, "is_loopback", lambda ip: False)
    with socket.create_server(("127.0.0.1", 0)) as machine_0:
        port = machine_0.getsockname()[1]
        assert "machine 0 answers" in env.check_rendezvous("x.yaml", _machines("127.0.0.1", port), 1)
        with pytest.raises(UserError, match=f"Port {port} is in use"):  # machine 0 could not host it
            env.check_rendezvous("x.yaml", _machines("127.0.0.1", port), 0)
    assert "can host it" in env.check_rendezvous("x.yaml", _machines("127.0.0.1", port), 0)
    assert "nothing listens" in env.check_rendezvous("x.yaml", _machines("127.0.0.1", port), 1)

    def no_route(*args, **kwargs):
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", no_route)
    with pytest.raises(UserError, match="cannot be reached from this machine within 3 s"):
        env.check_rendezvous("x.yaml", _machines("127.0.0.1", port), 1)


@pytest.mark.parametrize("world, here, host, own, refused", [
    ("2", "1", "localhost", "10.0.0.5", True),    # two machines meeting at localhost: each would host its own
    ("2", "1", "127.0.0.1", "10.0.0.5", True),
    ("2", "1", "10.0.0.1", "10.0.0.5", False),    # the first machine's network address
    ("2", "2", "127.0.0.1", "10.0.0.5", False),   # one machine: loopback is right
    ("2", "1", "127.0.0.1", None, False),         # no other address: every "machine" is this one
])
def test_a_worker_of_a_launch_across_machines_refuses_a_loopback_rendezvous(monkeypatch, world, here, host, own,
                                                                            refused):
    from my_utils.run import launch

    monkeypatch.setattr(launch, "network_address", lambda: own)
    for key, value in {"WORLD_SIZE": world, "LOCAL_WORLD_SIZE": here, "MASTER_ADDR": host, "RANK": "1",
                       "SLURMD_NODENAME": "n2"}.items():
        monkeypatch.setenv(key, value)
    if refused:
        with pytest.raises(UserError, match=rf"^Rank 1 on n2: the rendezvous host {host} is a loopback address, but "
                                            rf"this launch spans 2 machines.*this one's is 10.0.0.5\)\.$"):
            launch.check_rendezvous_host()
    else:
        launch.check_rendezvous_host()


def test_the_network_address_is_not_loopback():
    from my_utils.run.launch import is_loopback, network_address

    assert network_address() is None or not is_loopback(network_address())
