//! Routed experts in the servers' formats: payloads numpy built as vLLM (both generations) and
//! SGLang do (scripts/golden/routing_fixtures.py) read back to numpy's arrays, k3mini's own
//! encodings round-trip, and every malformed or mis-shaped payload is a named error.
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k3mini_teacher::routing::wire::{
    RoutedExperts, RoutingShape, WireError, from_npy, from_sglang, from_vllm, from_vllm_lists,
    to_npy, to_sglang,
};
use serde_json::Value;

fn fixtures() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/routing/payloads.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn shape(doc: &Value) -> RoutingShape {
    let s = &doc["shape"];
    let n = |key: &str| s[key].as_u64().unwrap() as usize;
    RoutingShape {
        layers: n("layers"),
        k: n("k"),
        experts: n("experts"),
        moe_layers: s["moe_layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_u64().unwrap() as usize)
            .collect(),
    }
}

/// numpy's `[tokens, layers, k]` lists as ids.
fn expected(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t.as_array().unwrap())
        .flat_map(|l| l.as_array().unwrap())
        .map(|e| e.as_u64().unwrap() as u32)
        .collect()
}

fn check_against_numpy(name: &str, got: RoutedExperts, f: &Value, shape: &RoutingShape) {
    let want = expected(&f["expected"]);
    let tokens = f["expected"].as_array().unwrap().len();
    assert_eq!(
        (got.tokens, got.layers, got.k),
        (tokens, shape.layers, shape.k),
        "{name}"
    );
    assert_eq!(got.ids, want, "{name}");
    got.check(tokens, shape).unwrap();
}

#[test]
fn vllm_npy_payloads_read_as_numpy_wrote_them_whatever_the_dtype() {
    let doc = fixtures();
    let shape = shape(&doc);
    for dtype in ["int32", "uint16", "uint8"] {
        let name = format!("vllm_npy_{dtype}");
        let f = &doc["fixtures"][&name];
        let b64 = f["response"]["choices"][0]["routed_experts"]
            .as_str()
            .unwrap();
        check_against_numpy(&name, from_vllm(b64).unwrap(), f, &shape);
    }
}

/// vLLM 0.21's nested lists, as the typed response field holds them.
fn lists(v: &Value) -> Vec<Vec<Vec<i64>>> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn vllm_0_21_nested_lists_join_prompt_and_generation() {
    let doc = fixtures();
    let shape = shape(&doc);
    let f = &doc["fixtures"]["vllm_0_21_lists"];
    let r = &f["response"];
    let prompt =
        from_vllm_lists(&lists(&r["prompt_routed_experts"]), shape.layers, shape.k).unwrap();
    let generated = from_vllm_lists(
        &lists(&r["choices"][0]["routed_experts"]),
        shape.layers,
        shape.k,
    )
    .unwrap();
    check_against_numpy("vllm_0_21", prompt.then(generated).unwrap(), f, &shape);
}

/// The SGLang fixture's payload, and what it reads as.
fn sglang(doc: &Value) -> (&str, RoutedExperts) {
    let shape = shape(doc);
    let f = &doc["fixtures"]["sglang_int32"];
    let b64 = f["response"]["meta_info"]["routed_experts"]
        .as_str()
        .unwrap();
    (b64, from_sglang(b64, shape.layers, shape.k).unwrap())
}

#[test]
fn sglang_raw_int32_reads_as_numpy_wrote_it() {
    let doc = fixtures();
    let f = &doc["fixtures"]["sglang_int32"];
    check_against_numpy("sglang", sglang(&doc).1, f, &shape(&doc));
}

#[test]
fn k3minis_encodings_round_trip() {
    let doc = fixtures();
    let (b64, r) = sglang(&doc);
    assert_eq!(to_sglang(&r), b64, "byte for byte SGLang's");
    let npy = to_npy(&r);
    // numpy's layout: the data starts on a 64-byte boundary after a newline-ended header.
    let header_len = u16::from_le_bytes([npy[8], npy[9]]) as usize;
    assert_eq!((10 + header_len) % 64, 0);
    assert_eq!(npy[10 + header_len - 1], b'\n');
    assert_eq!(from_npy(&npy).unwrap(), r);
    assert_eq!(from_vllm(&STANDARD.encode(&npy)).unwrap(), r);
    // And byte for byte what np.save writes for an int32 array.
    let f = &doc["fixtures"]["vllm_npy_int32"];
    let saved = f["response"]["choices"][0]["routed_experts"]
        .as_str()
        .unwrap();
    assert_eq!(STANDARD.encode(to_npy(&from_vllm(saved).unwrap())), saved);
}

/// An `.npy` file of `shape` with `descr` and raw `data`.
fn npy(descr: &str, shape: &str, data: &[u8]) -> String {
    let header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}\n");
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    STANDARD.encode(out)
}

fn i32s(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn malformed_and_mis_shaped_payloads_are_named_errors() {
    let doc = fixtures();
    let shape = shape(&doc);
    let err = |r: Result<RoutedExperts, WireError>| r.unwrap_err();
    assert!(matches!(
        err(from_vllm("not base64!")),
        WireError::Base64(_)
    ));
    assert!(matches!(
        err(from_vllm(&STANDARD.encode(b"PK\x03\x04 a zip"))),
        WireError::Npy(_)
    ));
    let good = npy("<i4", "(1, 2, 1)", &i32s(&[0, 1]));
    assert_eq!(from_vllm(&good).unwrap().ids, [0, 1]);
    // The data cut short, floats, big-endian, 2-D, a negative id.
    let short = npy("<i4", "(1, 2, 1)", &i32s(&[0]));
    assert!(matches!(err(from_vllm(&short)), WireError::Npy(m) if m.contains("4 data bytes")));
    let floats = npy("<f4", "(1, 2, 1)", &i32s(&[0, 1]));
    assert_eq!(err(from_vllm(&floats)), WireError::Dtype("<f4".into()));
    let big = npy(">i4", "(1, 2, 1)", &i32s(&[0, 1]));
    assert_eq!(err(from_vllm(&big)), WireError::Dtype(">i4".into()));
    let flat = npy("<i4", "(2, 1)", &i32s(&[0, 1]));
    assert!(matches!(err(from_vllm(&flat)), WireError::Shape { got, .. } if got == [2, 1]));
    let negative = npy("<i4", "(1, 2, 1)", &i32s(&[0, -1]));
    assert!(
        matches!(err(from_vllm(&negative)), WireError::Malformed(m) if m.contains("-1 at token 0, layer 1"))
    );
    // SGLang bytes that are not whole rows; lists of the wrong k.
    let ragged = STANDARD.encode(i32s(&[0; 5]));
    assert!(matches!(
        err(from_sglang(&ragged, 4, 3)),
        WireError::Malformed(_)
    ));
    let short_k: Value = serde_json::from_str("[[[0, 1], [0, 1], [0, 1], [0, 1]]]").unwrap();
    assert!(matches!(
        err(from_vllm_lists(&lists(&short_k), 4, 3)),
        WireError::Shape { .. }
    ));

    // Well-formed, but not this teacher's: tokens, layers, an expert it does not have.
    let (b64, r) = sglang(&doc);
    assert!(matches!(
        r.check(r.tokens + 1, &shape),
        Err(WireError::Shape { .. })
    ));
    let three_layers = from_sglang(b64, 3, 4).unwrap();
    assert!(matches!(
        three_layers.check(7, &shape),
        Err(WireError::Shape { .. })
    ));
    let mut wrong = r.clone();
    let at = (2 * shape.layers + 1) * shape.k; // token 2, layer 1, first slot
    wrong.ids[at] = shape.experts as u32;
    assert_eq!(
        wrong.check(wrong.tokens, &shape),
        Err(WireError::Expert {
            id: shape.experts as i64,
            token: 2,
            layer: 1,
            experts: shape.experts
        })
    );
    // A dense layer's row is not checked: servers leave anything there.
    let mut dense = r.clone();
    dense.ids[0] = 1000;
    dense.check(dense.tokens, &shape).unwrap();
}
