//! Routing shards: white-box and ids-only round trips, rows that do not fit the teacher's routing
//! refused before anything is written, and files whose metadata and rows disagree refused on
//! reading, by name.
use k3mini_data::routing::{
    LayerRouting, Routing, RoutingMeta, RoutingRow, RoutingShape, read_routing_shard,
    write_routing_shard,
};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use std::path::Path;

fn shape() -> RoutingShape {
    RoutingShape {
        layers: 5,
        k: 2,
        experts: 6,
        moe_layers: vec![1, 3, 4],
    }
}

/// Three segments of 4, 9 and 1 tokens, routed deterministically; weights and norms when `white`.
fn rows(white: bool) -> Vec<RoutingRow> {
    [4usize, 9, 1]
        .iter()
        .enumerate()
        .map(|(d, &tokens)| {
            let layers = shape()
                .moe_layers
                .iter()
                .map(|&layer| {
                    let experts: Vec<u32> = (0..tokens * 2)
                        .map(|i| ((i * 5 + layer + d) % 6) as u32)
                        .collect();
                    let values = |scale: f32| {
                        (0..tokens * 2)
                            .map(|i| scale * (1.0 + i as f32) / (3.0 + layer as f32))
                            .collect::<Vec<f32>>()
                    };
                    LayerRouting {
                        layer,
                        k: 2,
                        experts,
                        weights: white.then(|| values(0.5)),
                        norms: white.then(|| values(7.0)),
                    }
                })
                .collect();
            RoutingRow {
                doc_id: 1000 + d as u64,
                segment: d as u32,
                source: (d % 2) as u32,
                routing: Routing { layers },
            }
        })
        .collect()
}

fn meta(white: bool) -> RoutingMeta {
    RoutingMeta {
        teacher: "moe.gguf on llama.cpp".into(),
        sources: vec!["prose.txt".into(), "code".into()],
        shape: shape(),
        white_box: white,
    }
}

/// Rewrites `from` into `to` with its `k3mini.KEY` metadata changed as `edit` says.
fn rewrite(from: &Path, to: &Path, edit: &[(&str, &str)]) {
    let bytes = bytes::Bytes::from(std::fs::read(from).unwrap());
    let builder = ParquetRecordBatchReaderBuilder::try_new(bytes).unwrap();
    let mut kv: Vec<KeyValue> = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .unwrap()
        .iter()
        .filter(|kv| kv.key.starts_with("k3mini."))
        .cloned()
        .collect();
    for (key, value) in edit {
        let key = format!("k3mini.{key}");
        kv.retain(|e| e.key != key);
        kv.push(KeyValue::new(key, value.to_string()));
    }
    let schema = builder.schema().clone();
    let batches: Vec<_> = builder.build().unwrap().map(Result::unwrap).collect();
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(kv))
        .build();
    let mut w =
        ArrowWriter::try_new(std::fs::File::create(to).unwrap(), schema, Some(props)).unwrap();
    for b in &batches {
        w.write(b).unwrap();
    }
    w.close().unwrap();
}

#[test]
fn routing_shards_round_trip_white_box_and_ids_only() {
    let dir = crate::Dir::new("routing-shards");
    for white in [true, false] {
        let path = dir.0.join(format!("routing-{white}.parquet"));
        let bytes = write_routing_shard(&path, &meta(white), &rows(white)).unwrap();
        assert_eq!(bytes, std::fs::metadata(&path).unwrap().len());
        let back = read_routing_shard(&path, None).unwrap();
        assert_eq!(back.meta, meta(white));
        assert_eq!(back.rows, rows(white));
    }
}

#[test]
fn rows_that_do_not_fit_the_teachers_routing_are_refused_before_writing() {
    let dir = crate::Dir::new("routing-refused");
    let path = dir.0.join("routing-00000.parquet");
    let refused = |rows: Vec<RoutingRow>, white: bool| {
        let e = write_routing_shard(&path, &meta(white), &rows)
            .unwrap_err()
            .to_string();
        assert!(!path.exists(), "nothing is written");
        e
    };
    let mut bad = rows(true);
    bad[1].routing.layers[2].experts[5] = 6;
    let e = refused(bad, true);
    assert!(
        e.contains("row 1") && e.contains("layer 4, token 2: expert 6 of a teacher with 6 experts"),
        "{e}"
    );
    let mut bad = rows(false);
    bad[0].routing.layers.remove(1);
    let e = refused(bad, false);
    assert!(
        e.contains("layers [1, 4]") && e.contains("[1, 3, 4]"),
        "{e}"
    );
    let mut bad = rows(true);
    bad[2].routing.layers[0].norms.as_mut().unwrap()[1] = -1.0;
    let e = refused(bad, true);
    assert!(
        e.contains("layer 1: output norms not finite or negative"),
        "{e}"
    );
    let mut bad = rows(true);
    bad[0].routing.layers[1].weights.as_mut().unwrap().pop();
    let e = refused(bad, true);
    assert!(e.contains("layer 3: 7 weights for 8 choices"), "{e}");
    let mut bad = rows(false);
    bad[2].source = 2;
    let e = refused(bad, false);
    assert!(e.contains("row 2: source 2 of 2 sources"), "{e}");
    // Ids-only rows in a white-box shard, and the other way round.
    let e = refused(rows(false), true);
    assert!(e.contains("white_box = true"), "{e}");
    let e = refused(rows(true), false);
    assert!(e.contains("white_box = false"), "{e}");
}

#[test]
fn a_shard_whose_metadata_and_rows_disagree_is_refused_by_name() {
    let dir = crate::Dir::new("routing-tampered");
    let good = dir.0.join("good.parquet");
    write_routing_shard(&good, &meta(true), &rows(true)).unwrap();
    let bad = dir.0.join("bad.parquet");
    let read = |edit: &[(&str, &str)]| {
        rewrite(&good, &bad, edit);
        read_routing_shard(&bad, None).unwrap_err().to_string()
    };
    // Fewer experts than the rows use: the first id past them is named.
    let e = read(&[("experts", "4")]);
    assert!(
        e.contains("bad.parquet: row 0: layer 1, token 1: expert 5 of a teacher with 4 experts"),
        "{e}"
    );
    // Another k: the rows' lengths no longer fit.
    let e = read(&[("k", "3")]);
    assert!(
        e.contains("column experts: 24 values for 4 tokens × 3 MoE layers × k = 3"),
        "{e}"
    );
    let e = read(&[("moe_layers", "1,x,4")]);
    assert!(e.contains("k3mini.moe_layers"), "{e}");
    let e = read(&[("moe_layers", "1,3,5")]);
    assert!(e.contains("MoE layer 5 of a model with 5 layers"), "{e}");
    let e = read(&[("sources", "[\"prose.txt\"]")]);
    assert!(e.contains("row 1: source 1 of 1 sources"), "{e}");
    let e = read(&[("sources", "prose.txt")]);
    assert!(e.contains("k3mini.sources"), "{e}");
    let e = read(&[("kind", "teacher-signals")]);
    assert!(
        e.contains("holds teacher-signals, not teacher-routing"),
        "{e}"
    );
    // An ids-only file that claims weights and norms.
    let ids_only = dir.0.join("ids.parquet");
    write_routing_shard(&ids_only, &meta(false), &rows(false)).unwrap();
    rewrite(&ids_only, &bad, &[("white_box", "true")]);
    let e = read_routing_shard(&bad, None).unwrap_err().to_string();
    assert!(e.contains("no column weights"), "{e}");
    // The manifest's checksum, when given, must be the file's.
    let e = read_routing_shard(&good, Some(&"0".repeat(64)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("checksum mismatch"), "{e}");
}
