"""Careless or hostile inputs to the device commands end in one line and exit 2, never a hang,
a traceback or an allocation sized by the attacker: named pipes, huge budgets, compressed
archives that inflate past what a device holds, manifests that declare huge shapes or class
counts, an --out inside the bundle, a thread count past the machine."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from edge_runtime import cli as edge_cli
from edge_runtime._io import array_file_bytes, read_regular
from edge_runtime.bundle import BundleError, read_manifest
from edge_runtime.runtime import Runtime
from tests.helpers.bundles import (
    IMAGE_SPEC,
    NUM_CLASSES,
    build_bundle,
    make_image_encoder,
    make_images,
    rewrite_manifest,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX named pipes")


def _fails_in_one_line(argv: list[str], capsys, *needles: str) -> str:
    capsys.readouterr()
    assert edge_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_a_manifest_that_is_a_named_pipe_is_refused_without_blocking(tmp_path, capsys):
    bundle = tmp_path / "b"
    bundle.mkdir()
    os.mkfifo(bundle / "manifest.json")  # opening it for reading would wait for a writer
    _fails_in_one_line(["info", str(bundle)], capsys, "not a regular file")
    make_image_encoder(tmp_path / "enc.onnx")
    x, y = make_images(10)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    _fails_in_one_line(
        [
            "init",
            "--encoder",
            str(tmp_path / "enc.onnx"),
            "--data",
            str(tmp_path / "d.npz"),
            "--budget",
            "1MB",
            "--out",
            str(tmp_path / "o"),
            "--like",
            str(bundle),
        ],
        capsys,
        "not a regular file",
    )


def test_data_and_keys_that_are_pipes_are_refused(tmp_path, capsys):
    bundle = build_bundle(tmp_path)
    os.mkfifo(tmp_path / "x.npz")
    os.mkfifo(tmp_path / "key.pub")
    _fails_in_one_line(
        ["add", str(bundle), "--data", str(tmp_path / "x.npz")], capsys, "not a regular file"
    )
    _fails_in_one_line(["--trusted-key", str(tmp_path / "key.pub"), "info", str(bundle)], capsys)
    with pytest.raises(OSError, match="not a regular file"):
        read_regular(tmp_path / "x.npz", 10)


def test_a_huge_budget_works_without_allocating_it(tmp_path, capsys):
    """2**50 bytes: reading the encoder back used to ask for budget + 1 bytes up front."""
    make_image_encoder(tmp_path / "enc.onnx")
    x, y = make_images(30)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    (tmp_path / "spec.json").write_text(json.dumps(IMAGE_SPEC))
    out = tmp_path / "b"
    assert (
        edge_cli.main(
            [
                "init",
                "--encoder",
                str(tmp_path / "enc.onnx"),
                "--data",
                str(tmp_path / "d.npz"),
                "--budget",
                str(2**50),
                "--out",
                str(out),
                "--input-spec",
                str(tmp_path / "spec.json"),
            ]
        )
        == 0
    )
    rt = Runtime.load(out)
    assert rt.manifest.budget.total == 2**50
    assert rt.add(*make_images(5, 1)).added == 5


def _compressed_npz(path: Path, n: int) -> np.ndarray:
    """n zero images, deflated: a few KB on disk that declare n * 64 bytes in memory; returns
    their labels (0, 1, 2, ... modulo the classes, so which ones were kept shows)."""
    y = np.arange(n, dtype=np.int64) % NUM_CLASSES
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("x.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": "|u1", "fortran_order": False, "shape": (n, 8, 8, 1)}
            )
            chunk = bytes(64 * 1000)
            for _ in range(n // 1000):
                f.write(chunk)
        with zf.open("y.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, y)
    return y


def test_a_compressed_archive_that_inflates_past_the_limit_is_streamed(
    tmp_path, capsys, monkeypatch
):
    """Read in rows, not whole: the limit on what a file may take in memory does not apply,
    and the newest samples are kept, as an in-memory add keeps them."""
    bundle = build_bundle(tmp_path)
    reference = build_bundle(tmp_path, name="reference")
    y = _compressed_npz(tmp_path / "bomb.npz", 20_000)
    assert (tmp_path / "bomb.npz").stat().st_size < 20_000
    assert array_file_bytes(tmp_path / "bomb.npz") == 20_000 * 64 + 20_000 * 8
    monkeypatch.setattr(edge_cli, "DEVICE_INPUT_BYTES", 1_000_000)
    monkeypatch.setattr(edge_cli, "CHUNK_ROWS", 3_000)  # the kept samples span two chunks
    assert edge_cli.main(["add", str(bundle), "--data", str(tmp_path / "bomb.npz")]) == 0
    assert "received 20000: added 60" in capsys.readouterr().out
    streamed = Runtime.load(bundle).datastore
    np.testing.assert_array_equal(streamed.labels_, y[-60:])
    Runtime.load(reference).add(np.zeros((60, 8, 8, 1), np.uint8), y[-60:])
    np.testing.assert_allclose(streamed.keys(), Runtime.load(reference).datastore.keys(), atol=1e-6)
    assert edge_cli.main(["evaluate", str(bundle), "--data", str(tmp_path / "bomb.npz")]) == 0
    assert "on 20000 samples" in capsys.readouterr().out


_PEAK_OF_ADD = """
import sys
from edge_runtime.cli import main
from edge_runtime.runtime import Runtime
import numpy as np
Runtime.load(sys.argv[1]).predict_proba(np.zeros((1, 8, 8, 1), np.uint8))  # the bundle alone
before = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
assert main(["add", sys.argv[1], "--data", sys.argv[2]]) == 0
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
print(peak - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_add_of_an_archive_that_inflates_to_a_million_images_stays_small(tmp_path):
    """72 MB inflated (64 MB of pixels, 256 MB once normalised): add holds a chunk at a time."""
    bundle = build_bundle(tmp_path)
    _compressed_npz(tmp_path / "big.npz", 1_000_000)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_ADD, str(bundle), str(tmp_path / "big.npz")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout
    grown_mib = int(out.strip().splitlines()[-1]) / 1024
    assert grown_mib < 24, f"add of the archive grew the process by {grown_mib:.1f} MiB"


def test_an_npy_that_declares_more_than_it_holds_is_refused_before_allocating(tmp_path, capsys):
    bundle = build_bundle(tmp_path)
    with open(tmp_path / "x.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "|u1", "fortran_order": False, "shape": (2**40, 8, 8, 1)}
        )
        f.write(bytes(64))
    _fails_in_one_line(
        ["predict", str(bundle), "--input", str(tmp_path / "x.npy")],
        capsys,
        "declares a uint8 array",
    )


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"input": {**IMAGE_SPEC, "shape": [16000, 16000, 1]}}, "values per sample"),
        ({"num_classes": 2**40}, "'num_classes' is 1099511627776, over"),
        ({"embedding_dim": 2**20}, "'embedding_dim' is 1048576, over"),
    ],
)
def test_a_manifest_cannot_declare_sizes_a_device_would_allocate(tmp_path, capsys, changes, needle):
    bundle = build_bundle(tmp_path)
    rewrite_manifest(bundle, **changes)
    with pytest.raises(BundleError, match=needle.replace("'", ".")):
        read_manifest(bundle)
    _fails_in_one_line(["info", str(bundle)], capsys, needle)


def test_export_onnx_refuses_to_write_into_the_bundle_it_reads(tmp_path, capsys):
    bundle = build_bundle(tmp_path)
    before = (bundle / "encoder.onnx").read_bytes()
    _fails_in_one_line(
        ["export-onnx", str(bundle), "--out", str(bundle / "encoder.onnx")],
        capsys,
        "inside the bundle",
    )
    (tmp_path / "link").symlink_to(bundle)
    _fails_in_one_line(
        ["export-onnx", str(bundle), "--out", str(tmp_path / "link" / "p.onnx")],
        capsys,
        "inside the bundle",
    )
    assert (bundle / "encoder.onnx").read_bytes() == before
    Runtime.load(bundle)
    assert edge_cli.main(["export-onnx", str(bundle), "--out", str(tmp_path / "p.onnx")]) == 0


@pytest.mark.parametrize("suffix", [".keys.f32", ".labels.i64", ".app.json"])
@pytest.mark.parametrize("planted", ["link into the bundle", "directory"])
def test_keys_as_inputs_side_files_are_all_written_or_none(tmp_path, capsys, suffix, planted):
    """A link planted at a side file's name (here to the bundle's datastore) is never written
    through, and a side file that cannot be written is found before any file is: the bundle
    keeps what it learned and no other output appears."""
    work = tmp_path / "work"
    work.mkdir()
    bundle = build_bundle(work)
    before = {f.name: f.read_bytes() for f in bundle.iterdir()}
    out = tmp_path / "app.onnx"  # beside the work folder: what appears here is all it wrote
    side = Path(f"{out}{suffix}")
    if planted == "directory":
        side.mkdir()
    else:
        side.symlink_to(bundle / "datastore.npz")
    argv = ["export-onnx", str(bundle), "--out", str(out), "--keys-as-inputs"]
    _fails_in_one_line(argv, capsys, str(side))
    assert {f.name: f.read_bytes() for f in bundle.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["work", side.name])
    Runtime.load(bundle)
    (side.rmdir if planted == "directory" else side.unlink)()
    assert edge_cli.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["work", out.name, *(f"{out.name}{s}" for s in (".keys.f32", ".labels.i64", ".app.json"))]
    )


def test_threads_past_the_machine_are_refused(tmp_path, capsys):
    bundle = build_bundle(tmp_path)
    _fails_in_one_line(["--threads", "100000", "info", str(bundle)], capsys, "at most")


def test_predict_reads_and_writes_a_large_input_in_chunks(tmp_path, capsys, monkeypatch):
    """Memory-mapped in, chunk by chunk out: the probabilities file equals one call's."""
    bundle = build_bundle(tmp_path)
    x, _ = make_images(25, seed=3)
    np.save(tmp_path / "x.npy", x)
    monkeypatch.setattr(edge_cli, "CHUNK_ROWS", 7)
    out = tmp_path / "p.npy"
    assert (
        edge_cli.main(
            ["predict", str(bundle), "--input", str(tmp_path / "x.npy"), "--output", str(out)]
        )
        == 0
    )
    assert "predicted 25 input(s)" in capsys.readouterr().out
    np.testing.assert_allclose(np.load(out), Runtime.load(bundle).predict_proba(x), atol=1e-12)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("p.npy")) == ["p.npy"]
    np.save(tmp_path / "one.npy", x[0])
    assert edge_cli.main(["predict", str(bundle), "--input", str(tmp_path / "one.npy")]) == 0
    assert "predicted 1 input(s)" in capsys.readouterr().out


def _not_regular_outputs(directory: Path, suffix: str) -> list[Path]:
    """A named pipe, a link to one, a link to nothing and, where this user may make one, a
    copy of /dev/null's node (c 1 3): what an atomic rename used to replace."""
    directory.mkdir()
    os.mkfifo(directory / f"fifo{suffix}")
    (directory / f"link{suffix}").symlink_to(directory / f"fifo{suffix}")
    (directory / f"dangling{suffix}").symlink_to(directory / f"nothing{suffix}")
    try:
        os.mknod(directory / f"null{suffix}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        pass
    return sorted(p for p in directory.iterdir() if p.name != f"nothing{suffix}")


@pytest.mark.parametrize(("command", "suffix"), [("predict", ".npy"), ("export-onnx", ".onnx")])
def test_outputs_that_are_not_regular_files_are_refused_and_kept(tmp_path, capsys, command, suffix):
    bundle = build_bundle(tmp_path)
    x, _ = make_images(4)
    np.save(tmp_path / "x.npy", x)
    outs = _not_regular_outputs(tmp_path / "outs", suffix)
    kinds = {p: os.lstat(p).st_mode for p in outs}
    for path in outs:
        argv = (
            ["predict", str(bundle), "--input", str(tmp_path / "x.npy"), "--output"]
            if command == "predict"
            else ["export-onnx", str(bundle), "--out"]
        )
        _fails_in_one_line([*argv, str(path)], capsys, str(path), "give a file")
    assert {p: os.lstat(p).st_mode for p in outs} == kinds  # nothing replaced
    assert sorted((tmp_path / "outs").iterdir()) == outs  # and no temporary left


def test_predict_writes_through_a_link_and_to_standard_output(tmp_path, capsys):
    bundle = build_bundle(tmp_path)
    x, _ = make_images(4)
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "real.npy").write_bytes(b"old")
    (tmp_path / "link.npy").symlink_to(tmp_path / "real.npy")
    assert (
        edge_cli.main(
            [
                "predict",
                str(bundle),
                "--input",
                str(tmp_path / "x.npy"),
                "--output",
                str(tmp_path / "link.npy"),
            ]
        )
        == 0
    )
    assert (tmp_path / "link.npy").is_symlink()  # the link stays, its target is rewritten
    assert np.load(tmp_path / "real.npy").shape == (4, NUM_CLASSES)
    capsys.readouterr()
    script = (
        "import sys; from edge_runtime import cli; "
        f"sys.exit(cli.main(['predict', {str(bundle)!r}, '--input', "
        f"{str(tmp_path / 'x.npy')!r}, '--output', '-']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr
    assert np.load(io.BytesIO(done.stdout)).shape == (4, NUM_CLASSES)
    assert b"predicted 4 input(s)" in done.stderr
    _fails_in_one_line(
        ["predict", str(bundle), "--input", str(tmp_path / "x.npy"), "--output", "-", "--labels"],
        capsys,
        "choose one",
    )


def test_messages_name_the_file_and_the_fix(tmp_path, capsys):
    """A 400-digit prior_samples was `OverflowError: int too large to convert to float`; an
    --out that is a link was 'exists and is not a bundle' (now it is written through)."""
    bundle = build_bundle(tmp_path)
    m = json.loads((bundle / "manifest.json").read_text())
    m["lambda_rule"] = {
        "name": "pooled",
        "pooled": [[1.0, 1.0, 2.0]],
        "prior_samples": 1.0,
        "grid": [0.5],
    }
    (bundle / "manifest.json").write_text(
        json.dumps(m).replace('"prior_samples": 1.0', '"prior_samples": ' + "9" * 400)
    )
    _fails_in_one_line(
        ["info", str(bundle)], capsys, "manifest.json", "'prior_samples' must be a finite number"
    )
    (tmp_path / "o").mkdir()
    other = build_bundle(tmp_path / "o")
    make_image_encoder(tmp_path / "enc.onnx")
    x, y = make_images(20)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    # an --out that is a link is written as an upgrade writes one: into the directory it names
    argv = ["init", "--encoder", str(tmp_path / "enc.onnx"), "--data", str(tmp_path / "d.npz")]
    argv += ["--budget", "1MB", "--out", str(tmp_path / "link"), "--force", "--like", str(other)]
    assert edge_cli.main(argv) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "manifest.json").is_file()
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_init_names_the_n_that_does_not_fit(tmp_path, capsys):
    """`--recipes flat:int8:nN` over the budget said 'not enough for one stored sample of any
    candidate recipe': the n asked for is the problem, and the n that fits is the fix."""
    make_image_encoder(tmp_path / "enc.onnx")
    x, y = make_images(20)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    (tmp_path / "spec.json").write_text(json.dumps(IMAGE_SPEC))
    budget = (tmp_path / "enc.onnx").stat().st_size + 3000
    _fails_in_one_line(
        [
            "init",
            "--encoder",
            str(tmp_path / "enc.onnx"),
            "--data",
            str(tmp_path / "d.npz"),
            "--budget",
            str(budget),
            "--out",
            str(tmp_path / "o"),
            "--input-spec",
            str(tmp_path / "spec.json"),
            "--recipes",
            "flat:int8:n100000",
        ],
        capsys,
        "flat:int8:n100000 asks for 100000 samples",
        "use flat:int8:n",
    )
