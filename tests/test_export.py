"""Groups any trainer loads (issue 41 item 5): every committed run carries a HuggingFace dataset card that
datasets.load_dataset reads, and `pairmine export` writes (anchor, positive, negative_i) columns that
sentence-transformers' SentenceTransformerTrainer with MultipleNegativesRankingLoss trains on as they are."""

import json
import math

import pyarrow.parquet as pq

from pairmine.pipeline.cli import main


def _load(path):
    import datasets

    return datasets.load_dataset(str(path))["train"]


def test_a_committed_run_loads_with_datasets_and_its_data_folder_with_ray_and_pyarrow(tiny_groups, ray_local):
    import ray.data

    from pairmine.operators.write import GROUP_SCHEMA

    card = (tiny_groups / "README.md").read_text()
    assert card.startswith("---\nconfigs:\n- config_name: default\n") and "    path: groups/part-*.parquet\n" in card
    table = pq.read_table(tiny_groups / "groups")  # pyarrow reads the data folder: the card is not in it
    ds = _load(tiny_groups)
    assert ds.num_rows == table.num_rows > 0 and ds.column_names == GROUP_SCHEMA.names
    assert str(ds.features["related_texts"]) == "List(Value('string'))"
    assert ds[0]["group_id"] == table.column("group_id")[0].as_py()
    assert _load(tiny_groups / "groups").num_rows == table.num_rows
    assert ray.data.read_parquet(str(tiny_groups / "groups")).count() == table.num_rows


def _st_step(model_dir: str, dataset, tmp_path) -> tuple[float, float]:
    """Two steps of SentenceTransformerTrainer + MultipleNegativesRankingLoss on ``dataset``; returns (training
    loss, how far the first layer's weights moved)."""
    import torch
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    model = SentenceTransformer(model_dir, device="cpu")
    before = next(model.parameters()).detach().clone()
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path / "st"), max_steps=2, per_device_train_batch_size=4,
                                                learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                                                logging_steps=1, dataloader_num_workers=0)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset.select(range(8)),
                                         loss=MultipleNegativesRankingLoss(model))
    out = trainer.train()
    return out.training_loss, float((next(model.parameters()).detach() - before).abs().max())


def test_export_of_a_mine_run_trains_a_sentence_transformer(tiny_groups, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "st"
    assert main(["export", str(tiny_groups), str(out)]) == 0
    assert "columns anchor, positive; skipped: none" in capsys.readouterr().out
    groups = pq.read_table(tiny_groups / "groups").to_pylist()
    ds = _load(out)
    assert ds.column_names == ["anchor", "positive"] and ds.num_rows == len(groups)
    assert ds[0] == {"anchor": groups[0]["anchor_text"], "positive": groups[0]["related_texts"][0]}  # s1
    manifest = json.loads((out / "export_manifest.json").read_text())
    assert manifest["kind"] == "mine" and manifest["rows"] == len(groups) and manifest["skipped"] == {}
    loss, moved = _st_step(tiny_model_dir, ds, tmp_path)
    assert math.isfinite(loss) and loss > 0 and moved > 0
    # the same rows as JSON lines, and only the pair columns with --format pairs
    assert main(["export", str(tiny_groups), str(tmp_path / "j"), "--format", "jsonl"]) == 0
    lines = (tmp_path / "j" / "data" / "part-00000.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == ds[0] and _load(tmp_path / "j").num_rows == len(groups)
    # an output holding an export, and negatives asked of a mine run, are one error line each
    capsys.readouterr()
    assert main(["export", str(tiny_groups), str(out)]) == 2
    assert "holds an earlier export" in capsys.readouterr().err
    assert main(["export", str(tiny_groups), str(tmp_path / "n"), "--negatives", "3"]) == 2
    assert "is a mine run, which has no mined negatives" in capsys.readouterr().err


def test_export_refuses_what_is_not_a_committed_run(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "o")]) == 2
    assert "holds no manifest.json" in capsys.readouterr().err
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "manifest.json").write_text("{}")
    (tmp_path / "t" / "_SUCCESS").write_text("x")
    assert main(["export", str(tmp_path / "t"), str(tmp_path / "o")]) == 2
    assert "not a run of pairmine mine, filter-pairs or negatives" in capsys.readouterr().err
