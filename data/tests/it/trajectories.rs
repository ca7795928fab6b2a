//! Prompt sets (JSONL, CHAMP) and trajectory shards: a lossless round trip, one schema whatever
//! the rows, and refusal of files of the other kind.
use k3mini_data::chat::split_thinking;
use k3mini_data::prompts::{read_champ, read_prompts};
use k3mini_data::shards::{ShardMeta, ShardRow, Storage, read_shard, write_shard};
use k3mini_data::trajectories::{
    TrajectoryMeta, TrajectoryRow, read_trajectories, write_trajectories,
};
use k3mini_data::{DataError, Role};
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("k3mini-traj-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn jsonl_prompts_take_a_prompt_or_messages_and_name_bad_lines() {
    let dir = scratch("prompts");
    let good = dir.join("p.jsonl");
    std::fs::write(
        &good,
        concat!(
            r#"{"id": "a", "prompt": "What is 2 + 2?", "answer": 4}"#,
            "\n\n",
            r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}"#,
            "\n",
            r#"{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "w", "arguments": "{\"z\": 1, \"a\": 2}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "sunny"}], "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {"z": {}, "a": {}}}}}]}"#,
            "\n"
        ),
    )
    .unwrap();
    let p = read_prompts(&good).unwrap();
    assert_eq!(p.len(), 3);
    // Tool calls, results and declarations come through, their keys in the order written.
    assert_eq!((p[2].messages.len(), p[2].tools.len()), (3, 1));
    let args: Vec<&str> = p[2].messages[1].tool_calls[0]
        .function
        .arguments
        .0
        .iter()
        .map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(args, ["z", "a"]);
    assert_eq!((p[0].id.as_str(), p[0].answer.as_deref()), ("a", Some("4")));
    assert_eq!(p[0].messages[0].role, Role::User);
    assert_eq!((p[1].id.as_str(), p[1].messages.len()), ("p.jsonl:3", 2));
    let cases = [
        (r#"{"prompt": ""}"#, "`prompt` is not a non-empty string"),
        (r#"{"prompt": "x", "messages": []}"#, "exactly one of"),
        (
            r#"{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}"#,
            "must end with a turn for the assistant",
        ),
        (
            r#"{"prompt": "x", "answer": [1]}"#,
            "`answer` is not a string",
        ),
        (
            r#"{"prompt": "x", "tools": []}"#,
            "declare `tools` with `messages`",
        ),
        ("{nope", "invalid JSON"),
    ];
    for (line, want) in cases {
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, format!("{{\"prompt\": \"ok\"}}\n{line}\n")).unwrap();
        let e = read_prompts(&bad).unwrap_err();
        assert!(matches!(e, DataError::Record { line: 2, .. }), "{e}");
        assert!(e.to_string().contains(want), "{line}: {e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn champ_problems_come_in_category_then_numeric_order_with_answers() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/champ-excerpt.json");
    let p = read_champ(&path).unwrap();
    let ids: Vec<&str> = p.iter().map(|p| p.id.as_str()).collect();
    assert_eq!(
        ids,
        ["P_Combinatorics_2", "P_Combinatorics_10", "P_Inequality_1"]
    );
    assert_eq!(p[1].answer.as_deref(), Some("2^(n-1)"));
    assert!(
        p[0].messages[0]
            .content
            .starts_with("How many strings of length 5")
    );
    let dir = scratch("champ");
    std::fs::write(dir.join("v0.json"), r#"{"problems": [1, 2]}"#).unwrap();
    let e = read_champ(&dir.join("v0.json")).unwrap_err().to_string();
    assert!(e.contains("not a CHAMP v0.json"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn thinking_is_split_from_the_answer() {
    assert_eq!(
        split_thinking("<think>\n2 + 2 is 4\n</think>\n\nThe answer is 4."),
        (Some("2 + 2 is 4".into()), "The answer is 4.".into())
    );
    // A generation header that already opened the block: only the closing tag is generated.
    assert_eq!(
        split_thinking("add them</think>4"),
        (Some("add them".into()), "4".into())
    );
    assert_eq!(split_thinking(" just 4 "), (None, "just 4".into()));
}

fn meta() -> TrajectoryMeta {
    TrajectoryMeta {
        signals: ShardMeta {
            teacher: "SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            tokenizer_sha256: "cd".repeat(32),
            k: 3,
            temperature: 0.7,
            vocab: None,
        },
        top_p: 0.9,
        max_tokens: 64,
        seed: 5,
    }
}

fn row(i: u32, n: usize, thinking: Option<&str>, reference: Option<&str>) -> TrajectoryRow {
    TrajectoryRow {
        prompt_id: format!("p{i}"),
        prompt_ids: vec![1, 2, 3 + i],
        completion_ids: (0..n as u32).map(|t| 100 + t * 7 + i).collect(),
        logprobs: (0..n).map(|t| -0.25 * t as f32).collect(),
        top_ids: (0..n * 3).map(|j| (j * 13) as u32).collect(),
        top_logprobs: (0..n * 3).map(|j| -0.5 - j as f32 * 0.125).collect(),
        thinking: thinking.map(String::from),
        answer: format!("answer {i}"),
        finish_reason: if n < 4 { "stop" } else { "length" }.into(),
        reference: reference.map(String::from),
        tool_calls: Vec::new(),
    }
}

#[test]
fn trajectory_shards_round_trip_and_refuse_the_other_kind() {
    let dir = scratch("shards");
    let mut called = row(1, 5, None, Some("42"));
    called.tool_calls = serde_json::from_str(
        r#"[{"type": "function", "function": {"name": "get_weather",
            "arguments": "{\"city\": \"Zürich\", \"days\": [1, 2.5]}"}}]"#,
    )
    .unwrap();
    let rows = vec![
        row(0, 3, Some("think"), None),
        called,
        row(2, 0, None, None),
    ];
    let path = dir.join("t.parquet");
    write_trajectories(&path, &meta(), &rows).unwrap();
    let (m, back) = read_trajectories(&path, None).unwrap();
    assert_eq!((m, back), (meta(), rows.clone()));
    // Rows without nulls write the same schema (nullability is declared, not inferred).
    let all_set = dir.join("all.parquet");
    write_trajectories(&all_set, &meta(), &[row(3, 2, Some("t"), Some("r"))]).unwrap();
    let schema = |p: &Path| {
        let f = std::fs::File::open(p).unwrap();
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(f)
            .unwrap()
            .schema()
            .clone()
    };
    assert_eq!(schema(&path).fields(), schema(&all_set).fields());
    // Bad rows are refused before anything is written.
    let mut bad = rows.clone();
    bad[1].top_ids.pop();
    let e = write_trajectories(&dir.join("bad.parquet"), &meta(), &bad).unwrap_err();
    assert!(e.to_string().contains("prompt p1"), "{e}");
    let mut bad = rows.clone();
    bad[0].finish_reason = "eos".into();
    assert!(
        write_trajectories(&dir.join("bad.parquet"), &meta(), &bad)
            .unwrap_err()
            .to_string()
            .contains("not stop or length")
    );
    assert!(!dir.join("bad.parquet").exists());
    // A teacher-signal shard is not a trajectory shard, and the other way round.
    let signals = dir.join("s.parquet");
    let shard_meta = ShardMeta {
        teacher: "t".into(),
        tokenizer_sha256: "ab".repeat(32),
        k: 2,
        temperature: 1.0,
        vocab: None,
    };
    let srow = ShardRow {
        doc_id: 0,
        segment: 0,
        input_ids: vec![1, 2],
        parts: None,
        target_logprobs: vec![-1.0],
        top_ids: vec![2, 3],
        top_logprobs: vec![-1.0, -2.0],
    };
    write_shard(&signals, &shard_meta, Storage::Exact, &[srow]).unwrap();
    let e = read_trajectories(&signals, None).unwrap_err().to_string();
    assert!(e.contains("holds teacher-signals, not trajectories"), "{e}");
    let e = read_shard(&path, None).unwrap_err().to_string();
    assert!(e.contains("holds trajectories, not teacher-signals"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
