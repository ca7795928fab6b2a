//! Routing statistics against numpy's recount of the raw ids (teacher/tests/fixtures/routing,
//! scripts/golden/routing_fixtures.py): counts and co-selection of every served payload, and a
//! white-box set's REAP statistics (mean output norm, saliency with the weights renormalised over
//! the top-k, effective experts per token), experts in use, and per-source usage and
//! specialisation; then the report written from them.
use crate::fixture::Scratch;
use k3mini::routing::report::{table, write_report};
use k3mini::routing::stats::RoutingStats;
use k3mini_data::routing::{LayerRouting, Routing, RoutingMeta, RoutingRow, RoutingShape};
use k3mini_teacher::routing::wire::from_vllm_lists;
use serde_json::Value;

fn fixtures() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/teacher/tests/fixtures/routing/payloads.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn shape() -> RoutingShape {
    RoutingShape {
        layers: 4,
        k: 3,
        experts: 8,
        moe_layers: vec![1, 2, 3],
    }
}

fn u64s(v: &Value) -> Vec<u64> {
    serde_json::from_value(v.clone()).unwrap()
}

fn close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-6 * b.abs().max(1.0),
        "{what}: {a} vs numpy's {b}"
    );
}

#[test]
fn counts_and_co_selection_equal_numpys_recount_of_every_payload() {
    let doc = fixtures();
    for (name, f) in doc["fixtures"].as_object().unwrap() {
        let r = from_vllm_lists(
            &serde_json::from_value::<Vec<Vec<Vec<i64>>>>(f["expected"].clone()).unwrap(),
            4,
            3,
        )
        .unwrap();
        let mut stats = RoutingStats::new(&shape(), false, 1);
        stats.add(&RoutingRow {
            doc_id: 1,
            segment: 0,
            source: 0,
            routing: r.routing(&shape(), r.tokens),
        });
        for (i, l) in stats.layers.iter().enumerate() {
            assert_eq!(l.tokens as usize, r.tokens, "{name}");
            assert_eq!(l.counts, u64s(&f["counts"][i]), "{name} layer {}", l.layer);
            let co: Vec<u64> = f["co_selected"][i]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(u64s)
                .collect();
            assert_eq!(
                l.co_selected.as_ref(),
                Some(&co),
                "{name} layer {}",
                l.layer
            );
            assert_eq!(l.effective_k(), None, "ids only");
        }
    }
}

/// The white-box fixture's sequences as routing rows (source `i` for sequence `i`).
fn white_rows(doc: &Value) -> Vec<RoutingRow> {
    let seqs = doc["white_box"]["sequences"].as_array().unwrap();
    seqs.iter()
        .enumerate()
        .map(|(i, s)| {
            // numpy's [tokens, layers, k] as each MoE layer's [tokens, k].
            let take = |key: &str, layer: usize| -> Vec<f64> {
                s[key]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|t| {
                        t[layer]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|x| x.as_f64().unwrap())
                    })
                    .collect()
            };
            let layers = shape()
                .moe_layers
                .iter()
                .map(|&layer| LayerRouting {
                    layer,
                    k: 3,
                    experts: take("experts", layer).iter().map(|&x| x as u32).collect(),
                    weights: Some(take("weights", layer).iter().map(|&x| x as f32).collect()),
                    norms: Some(take("norms", layer).iter().map(|&x| x as f32).collect()),
                })
                .collect();
            RoutingRow {
                doc_id: i as u64,
                segment: 0,
                source: s["source"].as_u64().unwrap() as u32,
                routing: Routing { layers },
            }
        })
        .collect()
}

#[test]
fn reap_statistics_and_source_profiles_equal_numpys() {
    let doc = fixtures();
    let rows = white_rows(&doc);
    let mut stats = RoutingStats::new(&shape(), true, 2);
    rows.iter().for_each(|r| stats.add(r));
    let specialisation = stats.specialisation();
    for (i, want) in doc["white_box"]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let l = &stats.layers[i];
        let what = format!("layer {}", l.layer);
        assert_eq!(l.layer as u64, want["layer"].as_u64().unwrap());
        assert_eq!(l.tokens, want["tokens"].as_u64().unwrap(), "{what}");
        assert_eq!(l.counts, u64s(&want["counts"]), "{what}");
        let co: Vec<u64> = want["co_selected"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(u64s)
            .collect();
        assert_eq!(l.co_selected.as_ref(), Some(&co), "{what}");
        for (key, got) in [
            ("mean_norm", l.mean_norm().unwrap()),
            ("saliency", l.saliency().unwrap()),
        ] {
            for (j, (g, w)) in got.iter().zip(want[key].as_array().unwrap()).enumerate() {
                match (g, w.as_f64()) {
                    (Some(g), Some(w)) => close(*g, w, &format!("{what} {key} expert {j}")),
                    (None, None) => {}
                    _ => panic!("{what} {key} expert {j}: {g:?} vs numpy's {w}"),
                }
            }
        }
        close(
            l.effective_k().unwrap(),
            want["effective_k"].as_f64().unwrap(),
            &format!("{what} effective k"),
        );
        close(
            l.experts_in_use(),
            want["experts_in_use"].as_f64().unwrap(),
            &format!("{what} experts in use"),
        );
        for s in 0..2 {
            assert_eq!(
                stats.sources[s][i].counts,
                u64s(&want["source_counts"][s]),
                "{what} source {s}"
            );
            close(
                specialisation[s][i],
                want["specialisation"][s].as_f64().unwrap(),
                &format!("{what} source {s} specialisation"),
            );
        }
    }
    // The report: a table row per layer × expert overall and per source, the markdown and its
    // plots.
    let meta = RoutingMeta {
        teacher: "fixture".into(),
        sources: vec!["prose".into(), "code".into()],
        shape: shape(),
        white_box: true,
    };
    let rows = table(&stats, &meta, true);
    assert_eq!(rows.len(), 3 * 3 * 8);
    let overall: Vec<_> = rows.iter().filter(|r| r.source.is_none()).collect();
    assert_eq!(overall.len(), 24);
    assert_eq!(overall[8].layer, 2);
    assert_eq!(overall[8].count, stats.layers[1].counts[0]);
    assert!(
        rows.iter()
            .filter(|r| r.source.is_some())
            .all(|r| r.co_selected.is_none())
    );
    let dir = Scratch::new("routing-report");
    let report = write_report(&stats, &meta, true, &dir.0).unwrap();
    let md = std::fs::read_to_string(&report).unwrap();
    for needle in [
        "3 MoE layers of 4 hidden layers, 8 experts, k = 3",
        "| 1 | ",
        "## REAP saliency",
        "| prose | 9 |",
        "| code | 5 |",
        "![expert frequency per layer](usage.svg)",
    ] {
        assert!(md.contains(needle), "{needle:?} not in:\n{md}");
    }
    for file in [
        "routing.parquet",
        "usage.svg",
        "co-selection-1.svg",
        "profiles-3.svg",
    ] {
        let bytes = std::fs::read(dir.path(file)).unwrap();
        assert!(bytes.len() > 100, "{file}");
    }
    let svg = std::fs::read_to_string(dir.path("profiles-3.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("prose") && svg.contains("code"));
}
