"""One byte-count type for both command lines: the same strings mean the same bytes to `knnper
export` and `knnper-edge init`, and every malformed one is a one-line error with exit 2."""

from __future__ import annotations

import re

import pytest

import knnper_cli.main as export_cli
from edge_runtime.byte_count import MAX_BYTES, parse_byte_count
from edge_runtime.cli import _build_parser as edge_parser
from edge_runtime.cli import main as edge_main

GOOD = {
    "500000": 500_000,
    "500kB": 500_000,
    "500KB": 500_000,
    "500kb": 500_000,
    "500k": 500_000,
    "1.5MB": 1_500_000,
    "1.5M": 1_500_000,
    "1.5mb": 1_500_000,
    "2MiB": 2 * 2**20,
    "2mib": 2 * 2**20,
    "2Mi": 2 * 2**20,
    "512KiB": 512 * 1024,
    "1GB": 10**9,
    "1GiB": 2**30,
    " 7 ": 7,
    "0.5kB": 500,
    "1B": 1,
    "1PiB": MAX_BYTES,
    "2 MB": 2_000_000,
    "2M": 2_000_000,
}
BAD = [
    "",
    " ",
    "1.5",
    "0.1",
    "1.0005kB",
    "-1",
    "-1kB",
    "+5",
    "nan",
    "inf",
    "-inf",
    "1e15",
    "1e400",
    "0",
    "0kB",
    "kB",
    "MB",
    "2XB",
    "1.5.5MB",
    "1 000",
    "2MiBB",
    "1" * 400,
    "2PiB",
    "0x10",
]


@pytest.mark.parametrize(("text", "expected"), GOOD.items())
def test_parses_si_and_iec_in_any_case(text, expected):
    assert parse_byte_count(text) == expected


@pytest.mark.parametrize("text", BAD)
def test_refuses_what_is_not_a_whole_positive_byte_count(text):
    with pytest.raises(ValueError) as err:
        parse_byte_count(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("text", "expected"), GOOD.items())
def test_both_command_lines_read_the_same_bytes(text, expected):
    export = export_cli.build_parser().parse_args(["export", "RUN", "--out", "O", "--budget", text])
    edge = edge_parser().parse_args(
        [
            "init",
            "--encoder",
            "e.onnx",
            "--data",
            "d.npz",
            "--budget",
            text,
            "--out",
            "o",
            "--input-spec",
            "s.json",
        ]
    )
    assert export.budget == edge.budget == expected


def _exit_code(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.mark.parametrize("text", BAD)
@pytest.mark.parametrize("cli", ["export", "export --reference", "edge init"])
def test_every_malformed_byte_string_is_one_line_and_exit_2(tmp_path, capsys, text, cli):
    out = tmp_path / "out"
    if cli == "export":
        code = _exit_code(
            export_cli.main, ["export", str(tmp_path), "--out", str(out), f"--budget={text}"]
        )
    elif cli == "export --reference":
        code = _exit_code(
            export_cli.main,
            [
                "export",
                str(tmp_path),
                "--out",
                str(out),
                "--profile",
                "weak-strong",
                f"--reference={text}",
            ],
        )
    else:
        code = _exit_code(
            edge_main,
            [
                "init",
                "--encoder",
                "e.onnx",
                "--data",
                "d.npz",
                f"--budget={text}",
                "--out",
                str(out),
                "--input-spec",
                "s.json",
            ],
        )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and "byte" in err, err
    assert not out.exists()


def test_the_docs_list_spellings_the_parser_takes_and_refuses():
    from pathlib import Path

    page = " ".join((Path(__file__).parents[1] / "docs" / "concepts.md").read_text().split())
    sentence = page[page.index("Budgets are written") :].split("error.")[0]
    accepted, refused = sentence.split("anything else")
    for text in re.findall(r"`([^`]+)`", accepted):
        if text != "B":
            assert parse_byte_count(text) > 0, text
    for text in re.findall(r"`([^`]+)`", refused):
        with pytest.raises(ValueError):
            parse_byte_count(text)
    assert "`2 MB`" in accepted and "`2M`" in accepted
