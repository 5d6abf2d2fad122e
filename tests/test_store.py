import json
import os

import numpy as np
import pytest
import xarray as xr

from stabstudy.interventions.perturb import Perturbation
from stabstudy.run.store import SHARED_CHANNELS, CorruptRunError, load_runs
from stabstudy.spec import RunSpec


def toy_spec(seed=0, **hp):
    return RunSpec("toy", "gd", "digits", steps=12, seed=seed, hparams={"lr": 0.1, **hp})


def trajectory(n=12, **extra):
    data = {"loss": ("step", np.linspace(2, 1, n)), "grad_norm": ("step", np.ones(n))}
    data.update({k: ("step", v) for k, v in extra.items()})
    return xr.Dataset(data, coords={"step": np.arange(n)})


def test_save_load_roundtrip_with_provenance(tmp_store):
    s = RunSpec("toy", "adam", "digits", 12, 3, {"lr": 0.01, "beta2": 0.99},
                (Perturbation("lr_spike", 4, duration=2, dose=10.0),))
    path = tmp_store.save(trajectory(), s, "ok", wall_time_s=1.5)
    assert path == tmp_store.path(s) and path.name == f"{s.spec_hash}.nc"
    ds = tmp_store.load(s)
    for attr in ("spec", "spec_hash", "domain", "perturbation", "seed", "stabstudy_version", "git_commit",
                 "torch_version", "created_utc", "wall_time_s", "status"):
        assert attr in ds.attrs, attr
    assert RunSpec.from_json(ds.attrs["spec"]) == s
    assert json.loads(ds.attrs["perturbation"])[0]["kind"] == "lr_spike"
    assert ds.attrs["status"] == "ok" and ds.attrs["seed"] == 3
    # every shared channel exists; unmeasured ones are NaN, and `perturbed` follows the schedule
    for name in SHARED_CHANNELS:
        assert name in ds, name
    assert np.isnan(ds["lambda_max"]).all()
    assert ds["perturbed"].values.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
    np.testing.assert_allclose(ds["loss"], np.linspace(2, 1, 12))


def test_write_is_atomic_when_interrupted(tmp_store, monkeypatch):
    from stabstudy.run.store import LOCKS_DIR

    s = toy_spec()

    def boom(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(xr.Dataset, "to_netcdf", boom)
    with pytest.raises(KeyboardInterrupt):
        tmp_store.save(trajectory(), s, "ok", 0.0)
    assert not tmp_store.path(s).exists()
    assert sorted(os.listdir(tmp_store.root)) == [LOCKS_DIR]  # no temporary file left behind


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_hash"])
def test_corrupt_files_are_detected(tmp_store, damage):
    s = toy_spec()
    p = tmp_store.save(trajectory(), s, "ok", 0.0)
    if damage == "truncate":
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    elif damage == "garbage":
        p.write_bytes(b"not a netcdf file")
    else:
        other = toy_spec(seed=9)
        tmp_store.save(trajectory(), other, "ok", 0.0)
        os.replace(tmp_store.path(other), p)
    with pytest.raises(CorruptRunError):
        tmp_store.load(s)
    assert tmp_store.status(s) == "corrupt"
    assert tmp_store.table().set_index("spec_hash").loc[s.spec_hash, "status"] == "corrupt"


def test_failed_record(tmp_store):
    s = toy_spec()
    tmp_store.save_failed(s, "Traceback ...\nValueError: boom", 0.2)
    ds = tmp_store.load(s)
    assert ds.attrs["status"] == "failed" and "ValueError: boom" in ds.attrs["error"]
    assert ds.sizes["step"] == 0


def test_stored_runs_get_the_mode_of_a_plain_write(tmp_store):
    old = os.umask(0o027)
    try:
        path = tmp_store.save(trajectory(), toy_spec(), "ok", 0.0)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640  # 0666 less the umask; not mkstemp's private 0600


def test_load_runs_with_only_failed_runs_says_so(tmp_store):
    s = toy_spec()
    tmp_store.save_failed(s, "boom", 0.1)
    with pytest.raises(ValueError, match="every stored run of the given specs failed.*include_failed=True"):
        load_runs([s], store=tmp_store, include_failed=False)
    assert load_runs([s], store=tmp_store).sizes["run"] == 1


def test_load_runs_keeps_specs_apart_that_the_store_keeps_apart(tmp_store):
    """lr=1 and lr=1.0 are equal in Python but two specs (two hashes, two files): two runs."""
    a, b = toy_spec(lr=1), toy_spec(lr=1.0)
    tmp_store.save(trajectory(), a, "ok", 0.0)
    tmp_store.save(trajectory(), b, "ok", 0.0)
    assert load_runs([a, b], store=tmp_store).sizes["run"] == 2


def test_load_runs_aligns_runs_and_grid_coords(tmp_store):
    a = toy_spec(seed=0)
    b = RunSpec("toy", "adam", "digits", 15, 1, {"lr": 0.1, "beta2": 0.95},
                (Perturbation("lr_spike", 3, duration=2, dose=10.0),))
    tmp_store.save(trajectory(12, only_a=np.ones(12)), a, "ok", 0.0)
    tmp_store.save(trajectory(15), b, "diverged", 0.0)
    ds = load_runs([a, b, a], store=tmp_store)
    assert ds.sizes == {"run": 2, "step": 15}
    assert ds["run"].values.tolist() == [a.spec_hash, b.spec_hash]
    assert ds["learner"].values.tolist() == ["gd", "adam"]
    assert ds["status"].values.tolist() == ["ok", "diverged"]
    assert ds["pert_kind"].values.tolist() == ["none", "lr_spike"]
    assert np.isnan(ds["pert_dose"].values[0]) and ds["pert_dose"].values[1] == 10.0
    assert np.isnan(ds["hp_beta2"].values[0]) and ds["hp_beta2"].values[1] == 0.95
    assert np.isnan(ds["loss"].sel(run=a.spec_hash, step=14))  # shorter run is NaN-padded
    assert np.isnan(ds["only_a"].sel(run=b.spec_hash)).all()
    with pytest.raises(FileNotFoundError):
        load_runs([toy_spec(seed=5)], store=tmp_store)
    assert load_runs([a, toy_spec(seed=5)], store=tmp_store, missing="skip").sizes["run"] == 1


def test_conform_rejects_missing_step_dim(tmp_store):
    with pytest.raises(ValueError, match="'step' dimension"):
        tmp_store.save(xr.Dataset({"loss": ("t", np.ones(3))}), toy_spec(), "ok", 0.0)


def test_runs_record_package_versions_and_report_drift(tmp_store, monkeypatch):
    from stabstudy.run import runner
    from stabstudy.run.store import version_drift

    toy_spec = RunSpec("toy", "gd", "digits", 3, 0, {"width": 8})
    rl_spec = RunSpec("rl", "sac", "Pendulum-v1", 10, 0)
    runner.run_grid([toy_spec], scheduler="serial", store=tmp_store, progress=False)
    attrs = tmp_store.load(toy_spec).attrs
    for name in ("python", "torch", "numpy", "xarray", "scipy"):
        assert attrs[f"{name}_version"], name
    assert "stable_baselines3_version" not in attrs  # the toy domain does not use it
    assert version_drift(attrs, "toy") == []
    import stabstudy.run.store as S
    rl = S.provenance(rl_spec, "ok", 1.0)
    assert rl["stable_baselines3_version"] and rl["gymnasium_version"] and rl["mujoco_version"]
    old = {**attrs, "numpy_version": "1.0.0"}
    assert version_drift(old, "toy") == [f"numpy 1.0.0 -> {attrs['numpy_version']}"]
    # drift is reported, and recomputed only on request
    monkeypatch.setattr(tmp_store, "load", lambda spec: type("D", (), {"attrs": old})())
    assert runner.pending([toy_spec], tmp_store) == []
    monkeypatch.setenv("STABSTUDY_RERUN_STALE", "1")
    assert runner.pending([toy_spec], tmp_store) == [toy_spec]


def _flip_bit_in(path, values: np.ndarray, index: int) -> None:
    """Flip the lowest mantissa bit of ``values[index]`` where the array lies in the file."""
    raw = bytearray(path.read_bytes())
    at = bytes(raw).find(np.ascontiguousarray(values, dtype="<f8").tobytes())
    assert at > 0, "array not stored contiguously in the file"
    raw[at + 8 * index] ^= 0x01
    path.write_bytes(bytes(raw))


def test_one_flipped_bit_in_a_data_array_reads_as_corrupt_and_is_recomputed(tmp_store, capsys):
    import netCDF4

    from stabstudy.run import runner

    s = RunSpec("toy", "gd", "digits", 6, 0, {"width": 8})
    runner.run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    good = tmp_store.load(s)["loss"].values
    path = tmp_store.path(s)
    _flip_bit_in(path, good, 2)
    with netCDF4.Dataset(path) as f:  # the file still reads: only the data changed, by one ulp
        changed = f["loss"][:].data
    assert changed[2] != good[2] and np.isclose(changed[2], good[2], rtol=1e-14)
    assert np.array_equal(np.delete(changed, 2), np.delete(good, 2))
    with pytest.raises(CorruptRunError, match="does not match its checksum"):
        tmp_store.load(s)
    assert tmp_store.status(s) == "corrupt"
    capsys.readouterr()
    (rec,) = runner.run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert not rec.cached and "is corrupt (content does not match its checksum); recomputing" in capsys.readouterr().out
    np.testing.assert_array_equal(tmp_store.load(s)["loss"].values, good)


def test_the_checksum_covers_attributes_and_failed_records(tmp_store):
    import netCDF4

    a, b = toy_spec(seed=1), toy_spec(seed=2)
    tmp_store.save(trajectory(), a, "ok", 1.0)
    tmp_store.save_failed(b, "Traceback ...\nValueError: boom", 0.2)
    assert tmp_store.status(a) == "ok" and tmp_store.status(b) == "failed"
    with netCDF4.Dataset(tmp_store.path(a), "a") as f:
        f.setncattr("wall_time_s", 2.0)
    with netCDF4.Dataset(tmp_store.path(b), "a") as f:
        f.setncattr("error", "Traceback ...\nValueError: b00m")
    assert tmp_store.status(a) == tmp_store.status(b) == "corrupt"


def test_a_file_without_checksum_is_unverified_and_recomputed(tmp_store, capsys):
    """Written before runs carried a checksum: not used (it cannot be checked), listed, recomputed."""
    import netCDF4

    from stabstudy.run import runner
    from stabstudy.run.store import CHECKSUM_ATTR, UnverifiedRunError

    s = RunSpec("toy", "gd", "digits", 4, 0, {"width": 8})
    runner.run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    with netCDF4.Dataset(tmp_store.path(s), "a") as f:
        f.delncattr(CHECKSUM_ATTR)
    with pytest.raises(UnverifiedRunError, match="carries no checksum"):
        tmp_store.load(s)
    assert tmp_store.status(s) == "unverified"
    assert tmp_store.table()["status"].tolist() == ["unverified"]
    capsys.readouterr()
    (rec,) = runner.run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert not rec.cached and "carries no checksum" in capsys.readouterr().out
    assert tmp_store.status(s) == "ok"


def test_store_opening_removes_temporary_files_no_live_process_writes(tmp_store, hold_lock):
    import signal

    from stabstudy.run.store import RunStore

    dead, live = toy_spec(seed=1).spec_hash, toy_spec(seed=2).spec_hash
    tmp_store.root.mkdir(parents=True)
    left = tmp_store.root / f".{dead}.0123abcd.nc.tmp"  # what a Ctrl-C or a kill leaves behind
    writing = tmp_store.root / f".{live}.4567cdef.nc.tmp"
    proc = hold_lock(tmp_store.root, live)
    try:
        left.write_bytes(b"half a run")
        writing.write_bytes(b"half a run")
        RunStore(tmp_store.root)
        assert not left.exists() and writing.exists()  # the other process is still writing that one
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    RunStore(tmp_store.root)  # its writer crashed: the operating system released its lock
    assert not writing.exists()


def test_runs_of_another_stabstudy_version_are_flagged_and_rerun_on_request(tmp_store, monkeypatch, capsys):
    """Another package version is a reason (stabstudy runs flags it, --rerun-stale recomputes it);
    another git commit alone is not."""
    from stabstudy import __version__
    from stabstudy.run import runner
    from stabstudy.run.cli import main

    old, moved = RunSpec("toy", "gd", "digits", 3, 0, {"width": 8}), RunSpec("toy", "gd", "digits", 3, 1, {"width": 8})
    for s, who in ((old, {"stabstudy_version": "0.0.1"}), (moved, {"git_commit": "0123abc"})):
        result = runner.execute(s)
        runner._store_result(tmp_store, s, result, {**runner.made_by("toy"), **who})
    assert main(["runs", "--data", str(tmp_store.root)]) == 0
    out = capsys.readouterr().out
    assert f"stabstudy 0.0.1 -> {__version__}" in out and "1 runs were made with other versions" in out
    assert "--rerun-stale" in out
    assert runner.pending([old, moved], tmp_store) == []
    monkeypatch.setenv("STABSTUDY_RERUN_STALE", "1")
    assert runner.pending([old, moved], tmp_store) == [old]
    (rec, again) = runner.run_grid([old, moved], scheduler="serial", store=tmp_store, progress=False)
    assert not rec.cached and again.cached and tmp_store.load(old).attrs["stabstudy_version"] == __version__


def test_a_spec_that_does_not_hash_to_its_spec_hash_is_corrupt_and_recomputed(tmp_store, capsys):
    """Another spec's JSON put in a run's ``spec`` attribute, the checksum stamped again: the file
    reads as whole, but it no longer says which run it holds."""
    from stabstudy.run import runner
    from stabstudy.run.store import _stamp

    s, other = RunSpec("toy", "gd", "digits", 4, 0, {"width": 8}), RunSpec("toy", "gd", "digits", 4, 1, {"width": 8})
    runner.run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    ds = tmp_store.load(s)
    ds.attrs["spec"] = other.to_json()
    p = tmp_store.path(s)
    ds.to_netcdf(p.with_suffix(".swap"), engine="netcdf4")
    os.replace(p.with_suffix(".swap"), p)
    _stamp(p)  # a valid checksum over the replaced spec
    with pytest.raises(CorruptRunError, match="its spec hashes to"):
        tmp_store.load(s)
    assert tmp_store.status(s) == "corrupt"
    capsys.readouterr()
    (rec,) = runner.run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert not rec.cached and "is corrupt (spec does not match its hash); recomputing" in capsys.readouterr().out
    assert RunSpec.from_json(tmp_store.load(s).attrs["spec"]) == s


def _disk_full(monkeypatch, raised):
    """netCDF's write fails as it does on a full disk (``raised``), and the folder has no room left."""
    import errno

    def write(self, *a, **k):
        raise raised

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(xr.Dataset, "to_netcdf", write)
    monkeypatch.setattr(os, "posix_fallocate", no_room)


@pytest.mark.parametrize("raised", ["netcdf", "oserror"])
def test_a_full_disk_names_the_folder_and_the_cause_and_leaves_nothing_behind(tmp_store, monkeypatch, raised):
    """netCDF reports a full disk as ``RuntimeError: NetCDF: HDF error`` (no path, no cause): the store
    finds the cause (no room for the run in its folder) and says both."""
    import errno

    from stabstudy.run.store import LOCKS_DIR, RunWriteError

    s = toy_spec()
    _disk_full(monkeypatch, RuntimeError("NetCDF: HDF error") if raised == "netcdf"
               else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    with pytest.raises(RunWriteError) as exc:
        tmp_store.save(trajectory(), s, "ok", 0.0)
    assert exc.value.errno == errno.ENOSPC
    msg = str(exc.value)
    assert f"cannot store run {s.spec_hash} in {tmp_store.root}" in msg and "no space left on device" in msg
    assert sorted(os.listdir(tmp_store.root)) == [LOCKS_DIR]  # no temporary file, no run


def test_a_write_error_with_room_left_names_the_folder_and_netcdfs_error(tmp_store, monkeypatch):
    from stabstudy.run.store import RunWriteError

    def write(self, *a, **k):
        raise RuntimeError("NetCDF: HDF error")

    monkeypatch.setattr(xr.Dataset, "to_netcdf", write)
    with pytest.raises(RunWriteError, match=f"cannot store run .* in {tmp_store.root}: RuntimeError: NetCDF: HDF error") as exc:
        tmp_store.save(trajectory(), toy_spec(), "ok", 0.0)
    assert exc.value.errno is None


def test_a_grid_on_a_full_disk_stops_with_the_cause_and_stores_no_failed_run(tmp_store, monkeypatch):
    """A full disk is not the run's failure: the grid stops, and a rerun with room computes the run."""
    from stabstudy.run import runner
    from stabstudy.run.store import RunWriteError

    s = RunSpec("toy", "gd", "digits", 4, 0, {"width": 8})
    with monkeypatch.context() as m:
        _disk_full(m, RuntimeError("NetCDF: HDF error"))
        with pytest.raises(RunWriteError, match="no space left on device"):
            runner.run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert not tmp_store.path(s).exists()
    (rec,) = runner.run_grid([s], scheduler="serial", store=tmp_store, progress=False)
    assert rec.status == "ok" and not rec.cached


_FILL = """
import sys, numpy as np, xarray as xr
from stabstudy.run.store import RunStore, RunWriteError
from stabstudy.spec import RunSpec
store = RunStore(sys.argv[1])
big = xr.Dataset({"loss": ("step", np.random.default_rng(0).random(200_000))})
try:
    store.save(big, RunSpec("toy", "gd", "digits", 12, 0, {"lr": 0.1}), "ok", 1.0)
except RunWriteError as e:
    print("RunWriteError", e.errno, e)
"""


def test_a_real_full_disk_is_reported_as_such(tmp_path):
    """The same on a 600 KiB tmpfs (a user namespace: no root needed; skipped where there is none)."""
    import errno
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    if not unshare or subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode:
        pytest.skip("no user namespaces here: cannot mount a tmpfs without root")
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    script = (f"mount -t tmpfs -o size=600k tmpfs {tiny} && {sys.executable} -c '{_FILL}' {tiny} && ls -a {tiny}")
    out = subprocess.run([unshare, "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, *listing = out.stdout.splitlines()
    assert first.startswith(f"RunWriteError {errno.ENOSPC} cannot store run") and f"in {tiny}" in first
    assert "no space left on device" in first
    assert sorted(listing) == [".", "..", ".locks"]
