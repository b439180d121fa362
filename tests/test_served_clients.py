"""benchmarks/served_clients.py: the table of its summary (the run itself needs the demo pair)."""

from __future__ import annotations

from benchmarks.served_clients import table


def test_table_gives_batched_over_unbatched_and_each_count_over_one_client():
    summary = {"batched": {1: {"tok_per_s": 15.0, "tok_per_cpu_s": 7.5}, 8: {"tok_per_s": 37.5, "tok_per_cpu_s": 18.0}},
               "unbatched": {1: {"tok_per_s": 16.0, "tok_per_cpu_s": 8.0}, 8: {"tok_per_s": 15.0, "tok_per_cpu_s": 7.0}}}
    assert table(summary, [1, 8], ["batched", "unbatched"]) == [
        "| clients | batched tok/s (tok/CPU-s) | unbatched tok/s (tok/CPU-s) | batched / unbatched | "
        "batched N / unbatched 1 | batched N / batched 1 |",
        "|---:|---:|---:|---:|---:|---:|",
        "| 1 | 15.00 (7.50) | 16.00 (8.00) | 0.938 | 0.94x | 1.00x |",
        "| 8 | 37.50 (18.00) | 15.00 (7.00) | 2.500 | 2.34x | 2.50x |",
    ]
    # one mode alone: no ratios
    assert table({"batched": summary["batched"]}, [8], ["batched"])[-1] == "| 8 | 37.50 (18.00) | - | - | 2.50x |"


def test_variant_must_name_an_app_config_field(capsys):
    """--variant KEY=VALUE deploys every mode again with one AppConfig override; anything else is a
    usage error (exit 2) before Ray starts."""
    import pytest

    from benchmarks.served_clients import main

    from benchmarks.served_clients import parse_variant

    for bad in ("no_such_field=1", "omp_spin_count", "omp_spin_count="):
        with pytest.raises(SystemExit) as e:
            main(["--variant", bad])
        assert e.value.code == 2
        assert f"--variant: need KEY=VALUE with an AppConfig field as KEY, got {bad!r}" in capsys.readouterr().err
    # the value is read as a config file would hold it: omp_spin_count (a strict int) takes "0" as 0
    assert parse_variant("omp_spin_count=0") == ("omp_spin_count", 0)
    assert parse_variant("target_dtype=w8a8") == ("target_dtype", "w8a8")
    for bad in ("omp_spin_count=-1", "omp_spin_count=abc"):  # a value the field refuses: a usage error
        with pytest.raises(SystemExit) as e:
            main(["--variant", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--variant: " in err and "omp_spin_count" in err
