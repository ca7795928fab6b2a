//! `routing design` on routing built to a known structure: two domains, each using its own two
//! pairs of experts that always fire together, so the right groups, top-k and domain cut are
//! known in advance.
use crate::fixture::Scratch;
use k3mini::routing::design::{Design, DesignOptions, depth_map, design_from};
use k3mini::routing::stats::RoutingStats;
use k3mini_data::routing::{LayerRouting, Routing, RoutingMeta, RoutingRow, RoutingShape};

fn shape() -> RoutingShape {
    RoutingShape {
        layers: 4,
        k: 2,
        experts: 8,
        moe_layers: vec![1, 2, 3],
    }
}

fn meta() -> RoutingMeta {
    RoutingMeta {
        teacher: "synthetic".into(),
        sources: vec!["prose".into(), "code".into()],
        shape: shape(),
        white_box: false,
    }
}

/// Source 0's tokens take the pair {0,1} or {2,3}; source 1's {4,5} or {6,7}; in every layer.
/// With `crossing`, source 0's odd tokens take {1,2} instead (spanning two of the pairs).
fn rows(crossing: bool) -> Vec<RoutingRow> {
    (0..2u32)
        .flat_map(|source| {
            (0..3u32).map(move |segment| {
                let experts: Vec<u32> = (0..40u32)
                    .flat_map(|t| {
                        let base = 4 * source + 2 * ((t / 3 + segment) % 2);
                        if crossing && source == 0 && t % 2 == 1 {
                            [1, 2]
                        } else {
                            [base, base + 1]
                        }
                    })
                    .collect();
                RoutingRow {
                    doc_id: (source * 10 + segment) as u64,
                    segment: 0,
                    source,
                    routing: Routing {
                        layers: [1, 2, 3]
                            .into_iter()
                            .map(|layer| LayerRouting {
                                layer,
                                k: 2,
                                experts: experts.clone(),
                                weights: None,
                                norms: None,
                            })
                            .collect(),
                    },
                }
            })
        })
        .collect()
}

fn run(rows: &[RoutingRow], opts: &DesignOptions) -> k3mini::error::Result<Design> {
    let mut stats = RoutingStats::new(&shape(), false, 2);
    rows.iter().for_each(|r| stats.add(r));
    design_from(&stats, &meta(), opts, &mut |on_row| {
        rows.iter().for_each(|r| on_row(r));
        Ok(())
    })
}

fn opts(experts: usize) -> DesignOptions {
    DesignOptions {
        experts,
        domain: None,
        layers: None,
        first_dense_layers: None,
    }
}

#[test]
fn experts_that_fire_together_become_one_student_expert() {
    let d = run(&rows(false), &opts(4)).unwrap();
    assert_eq!(
        (d.n_layers, d.first_dense_layers),
        (4, 1),
        "the teacher's depth"
    );
    assert_eq!(d.layers.len(), 3);
    for l in &d.layers {
        assert_eq!(
            l.groups,
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(l.distinct_groups, 1.0, "each token's pair is one group");
        let total: f64 = l.mass.iter().sum();
        assert!((total - 1.0).abs() < 1e-12, "{:?}", l.mass);
    }
    assert_eq!(d.top_k, 1);
    assert_eq!(
        d.layers.iter().map(|l| l.teacher_layer).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );

    // Two student experts: the domains split, a token's pair always inside one.
    let two = run(&rows(false), &opts(2)).unwrap();
    assert_eq!(
        two.layers[0].groups,
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
    );

    // Tokens whose experts span two groups raise the distinct count and so the top-k.
    let crossing = run(&rows(true), &opts(4)).unwrap();
    let l = &crossing.layers[0];
    assert!(l.distinct_groups > 1.2, "{}", l.distinct_groups);
    assert_eq!(crossing.top_k, 1 + (l.distinct_groups >= 1.5) as usize);
}

#[test]
fn a_domain_design_leaves_out_the_experts_it_never_uses() {
    let code = DesignOptions {
        domain: Some("code".into()),
        ..opts(2)
    };
    let d = run(&rows(false), &code).unwrap();
    assert_eq!(d.layers[0].groups, vec![vec![4, 5], vec![6, 7]]);
    assert_eq!(d.tokens, 3 * 40, "the domain's tokens");

    let too_many = DesignOptions {
        domain: Some("code".into()),
        ..opts(5)
    };
    let err = run(&rows(false), &too_many).unwrap_err().to_string();
    assert!(err.contains("only 4 of its 8 experts"), "{err}");
    let unknown = DesignOptions {
        domain: Some("maths".into()),
        ..opts(2)
    };
    let err = run(&rows(false), &unknown).unwrap_err().to_string();
    assert!(err.contains("maths") && err.contains("prose"), "{err}");
}

#[test]
fn depth_maps_by_relative_depth_and_the_design_reads_back_checked() {
    assert_eq!(depth_map(2, 3), vec![0, 2]);
    assert_eq!(depth_map(4, 3), vec![0, 1, 1, 2]);
    assert_eq!(depth_map(1, 3), vec![1]);
    let shallow = DesignOptions {
        layers: Some(3),
        ..opts(4)
    };
    let d = run(&rows(false), &shallow).unwrap();
    assert_eq!(
        d.layers
            .iter()
            .map(|l| (l.student_layer, l.teacher_layer))
            .collect::<Vec<_>>(),
        vec![(1, 1), (2, 3)]
    );

    let dir = Scratch::new("routing-design");
    let (map, fragment) = d.write(&dir.0, &dir.0).unwrap();
    assert_eq!(Design::read(&map).unwrap(), d);
    let toml = std::fs::read_to_string(&fragment).unwrap();
    assert!(
        toml.contains("num_experts = 4\ntop_k = 1\nfirst_dense_layers = 1"),
        "{toml}"
    );

    let mut bad = d.clone();
    bad.layers[0].groups[1] = vec![1, 2];
    std::fs::write(&map, serde_json::to_string(&bad).unwrap()).unwrap();
    let err = Design::read(&map).unwrap_err().to_string();
    assert!(err.contains("disjoint"), "{err}");
}
