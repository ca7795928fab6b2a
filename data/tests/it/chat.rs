//! Chat templates: the exact strings of ChatML, Kimi K2 and Kimi K3 (K3's held to its reference
//! template's renderings, scripts/golden/chat_templates.py), special tokens as single ids, and parts
//! that put each token in the prompt, the thinking or the answer.
use k3mini_data::chat::{Json, Part, check_markers, render};
use k3mini_data::{Chat, ChatFormat, LossParts, Message, Role, Tokenizer};
use std::path::Path;

fn conversation() -> Vec<Message> {
    let m = |role, content: &str, thinking: Option<&str>| Message {
        thinking: thinking.map(Into::into),
        ..Message::new(role, content)
    };
    vec![
        m(Role::System, "You are terse.", None),
        m(Role::User, "What is 2+3?", None),
        m(Role::Assistant, "5", Some("2 plus 3 is 5.")),
    ]
}

#[test]
fn chatml_renders_like_qwen3_and_smollm2() {
    let r = render(&conversation(), &[], ChatFormat::Chatml, false).unwrap();
    assert_eq!(
        r.text(),
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n\
         <|im_start|>assistant\n<think>\n2 plus 3 is 5.\n</think>\n\n5<|im_end|>\n"
    );
    let prompt = render(&conversation()[..2], &[], ChatFormat::Chatml, true).unwrap();
    assert!(
        prompt
            .text()
            .ends_with("<|im_end|>\n<|im_start|>assistant\n")
    );
}

#[test]
fn kimi_k2_renders_its_turn_markers() {
    let r = render(&conversation(), &[], ChatFormat::KimiK2, false).unwrap();
    assert_eq!(
        r.text(),
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|><|im_user|>user<|im_middle|>What is 2+3?\
         <|im_end|><|im_assistant|>assistant<|im_middle|><think>2 plus 3 is 5.</think>5<|im_end|>"
    );
}

#[test]
fn kimi_k2_tokens_carry_their_part() {
    // K2's markers are not K3's (its vocabulary renames their ids), and K3's are not K2's.
    let tok = Tokenizer::load("kimi_k2").unwrap();
    check_markers(ChatFormat::KimiK2, &tok).unwrap();
    let k3 = Tokenizer::load("kimi").unwrap();
    let e = check_markers(ChatFormat::KimiK2, &k3)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("<|im_system|>") && e.contains("\"kimi_k3\""),
        "{e}"
    );
    let e = check_markers(ChatFormat::KimiK3, &tok)
        .unwrap_err()
        .to_string();
    assert!(e.contains("<|open|>") && e.contains("\"kimi_k2\""), "{e}");
    let r = render(&conversation(), &[], ChatFormat::KimiK2, false).unwrap();
    let (ids, parts) = r.encode(&tok).unwrap();
    assert_eq!(ids.len(), parts.len());
    let im_end = tok.token_id("<|im_end|>").expect("a special token");
    // Markers are single ids; the think tags are Kimi's reserved ids.
    assert_eq!(ids.iter().filter(|&&i| i == im_end).count(), 3);
    let think = ids.iter().position(|&i| i == 163_606).expect("<think>");
    let end_think = ids.iter().position(|&i| i == 163_607).expect("</think>");
    assert!(
        parts[think..=end_think]
            .iter()
            .all(|&p| p == Part::Thinking)
    );
    // The answer is "5" and the <|im_end|> that closes it.
    let tail: Vec<Part> = parts[end_think + 1..].to_vec();
    assert_eq!(tail, [Part::Answer, Part::Answer]);
    assert_eq!(ids[ids.len() - 1], im_end);
    // Decoding the ids gives the rendered text back.
    assert_eq!(tok.decode(&ids).unwrap(), r.text());
    // Default loss parts: thinking and answer, not the prompt or markup.
    let trained: Vec<bool> = parts
        .iter()
        .map(|&p| LossParts::default().trains(p))
        .collect();
    assert_eq!(
        trained.iter().filter(|&&t| t).count(),
        end_think - think + 1 + 2
    );
    let answer_only = LossParts {
        thinking: false,
        ..Default::default()
    };
    assert_eq!(parts.iter().filter(|&&p| answer_only.trains(p)).count(), 2);
}

#[test]
fn bad_conversations_are_refused() {
    assert!(
        render(&[], &[], ChatFormat::KimiK2, false)
            .unwrap_err()
            .to_string()
            .contains("no messages")
    );
    let mut c = conversation();
    c[1].thinking = Some("x".into());
    assert!(
        render(&c, &[], ChatFormat::Chatml, false)
            .unwrap_err()
            .to_string()
            .contains("message 1: only assistant turns carry thinking")
    );
}

/// A format's cases of `scripts/golden/chat_templates.py`: (name, conversation, generation
/// prompt, the text its reference template renders through transformers' Jinja: llama.cpp's
/// Kimi-K3.jinja for `kimi_k3`, Kimi-K2-Thinking.jinja for `kimi_k2`, Qwen3's for `chatml`).
fn golden(format: ChatFormat) -> Vec<(String, Chat, bool, String)> {
    golden_of(format.name())
}

/// The cases under `key` (a format, or `chatml_k3mini`: k3mini's own ChatML template, which an
/// exported GGUF carries, rendering the chatml cases and those where Qwen3's differs).
fn golden_of(key: &str) -> Vec<(String, Chat, bool, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_templates.json");
    // Read in order: a declaration's keys that differ only in case sort in written order.
    let golden = Json::parse(&std::fs::read_to_string(path).unwrap()).unwrap();
    let Some(Json::Array(cases)) = golden.get(key) else {
        panic!("no {key} cases")
    };
    assert!(cases.len() >= 5, "{key}: {} cases", cases.len());
    let text = |case: &Json, key: &str| match case.get(key) {
        Some(Json::String(s)) => s.clone(),
        other => panic!("{key}: {other:?}"),
    };
    cases
        .iter()
        .map(|case| {
            let line = serde_json::to_string(case).unwrap();
            let chat = Chat::from_record(&line, "messages").unwrap();
            let prompt = case.get("add_generation_prompt") == Some(&Json::Bool(true));
            (text(case, "name"), chat, prompt, text(case, "text"))
        })
        .collect()
}

#[test]
fn each_format_renders_as_its_reference_template_and_reads_its_replies_back() {
    for format in [ChatFormat::KimiK3, ChatFormat::KimiK2, ChatFormat::Chatml] {
        for (name, chat, prompt, want) in golden(format) {
            let got = render(&chat.messages, &chat.tools, format, prompt).unwrap();
            assert_eq!(got.text(), want, "{}: {name}", format.name());
            // The last assistant turn, written after its generation prompt, parses back to it.
            let Some(at) = chat
                .messages
                .iter()
                .rposition(|m| m.role == Role::Assistant)
            else {
                continue;
            };
            let before = render(&chat.messages[..at], &chat.tools, format, true).unwrap();
            let upto = render(&chat.messages[..=at], &chat.tools, format, false).unwrap();
            let upto = upto.text();
            let reply = upto[before.text().len()..].trim_end_matches('\n');
            let reply = reply.strip_suffix(format.end_of_turn()).unwrap();
            let m = &chat.messages[at];
            if m.content.contains("<|") {
                // Decoded, text that quotes a marker reads as the marker: refused, not misread.
                assert!(format.parse_reply(reply).unwrap_err().contains("stray"));
                continue;
            }
            let r = format.parse_reply(reply).unwrap();
            assert_eq!(r.content, m.content.trim(), "{name}");
            assert_eq!(r.calls.len(), m.tool_calls.len(), "{name}");
            for (got, want) in r.calls.iter().zip(&m.tool_calls) {
                assert_eq!(got.function, want.function, "{name}");
            }
        }
    }
}

#[test]
fn the_template_an_export_carries_renders_as_k3mini_does() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_templates.json");
    let fixture = Json::parse(&std::fs::read_to_string(path).unwrap()).unwrap();
    // ChatML's is k3mini's own; the Kimi formats' are the reference templates the golden cases
    // were rendered with (the script copies them and records their hashes).
    for (format, file, hash) in [
        (ChatFormat::Chatml, "chatml.jinja", "chatml_k3mini_sha256"),
        (ChatFormat::KimiK3, "Kimi-K3.jinja", "kimi_k3_sha256"),
        (
            ChatFormat::KimiK2,
            "Kimi-K2-Thinking.jinja",
            "kimi_k2_sha256",
        ),
    ] {
        let template = format.jinja();
        assert_eq!(ChatFormat::of_template(template), Some(format));
        let on_disk = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("src/chat/templates")
                .join(file),
        )
        .unwrap();
        assert_eq!(template, on_disk, "{file}");
        assert_eq!(
            fixture.get(hash),
            Some(&Json::String(k3mini_data::digest::sha256_hex(
                template.as_bytes()
            ))),
            "{file} is not the template the golden cases were rendered with: rerun \
             scripts/golden/chat_templates.py"
        );
    }
    // ChatML's own template renders every case as Qwen3's does, and the cases where Qwen3
    // differs as k3mini's renderer does.
    let cases = golden_of("chatml_k3mini");
    assert!(cases.len() > golden(ChatFormat::Chatml).len());
    for (name, chat, prompt, want) in cases {
        let got = render(&chat.messages, &chat.tools, ChatFormat::Chatml, prompt).unwrap();
        assert_eq!(got.text(), want, "{name}");
    }
}

#[test]
fn chatml_markers_are_single_ids_and_quoted_markers_are_text() {
    let dir = std::env::temp_dir().join(format!("k3mini-chatml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = dir.join("corpus.txt");
    std::fs::write(
        &corpus,
        "the user asks and the assistant answers.\n".repeat(50),
    )
    .unwrap();
    let path = dir.join("tokenizer.json");
    let specials = ["<|im_start|>", "<|im_end|>"];
    k3mini_data::tokenizer::train_byte_level_bpe(
        &[corpus.display().to_string()],
        300,
        &specials,
        &path,
    )
    .unwrap();
    let tok = Tokenizer::load(path.to_str().unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    check_markers(ChatFormat::Chatml, &tok).unwrap();
    let end = tok.token_id("<|im_end|>").unwrap();
    for (name, chat, prompt, text) in golden(ChatFormat::Chatml) {
        let r = render(&chat.messages, &chat.tools, ChatFormat::Chatml, prompt).unwrap();
        let (ids, parts) = r.encode(&tok).unwrap();
        assert_eq!(ids.len(), parts.len());
        assert_eq!(tok.decode(&ids).unwrap(), text, "{name}");
        // One <|im_end|> id per turn (a run of tool results is one), however often people's
        // text quotes it.
        let tools_turn = usize::from(!chat.tools.is_empty());
        let system_joined =
            usize::from(!chat.tools.is_empty() && chat.messages[0].role == Role::System);
        let runs = chat
            .messages
            .iter()
            .zip(chat.messages.iter().skip(1).map(Some).chain([None]))
            .filter(|(m, next)| m.role != Role::Tool || next.is_none_or(|n| n.role != Role::Tool))
            .count();
        assert_eq!(
            ids.iter().filter(|&&i| i == end).count(),
            runs + tools_turn - system_joined,
            "{name}"
        );
    }
}

/// The text of the ids of one part.
fn decoded(tok: &Tokenizer, ids: &[u32], parts: &[Part], part: Part) -> String {
    let picked: Vec<u32> = ids
        .iter()
        .zip(parts)
        .filter(|(_, p)| **p == part)
        .map(|(i, _)| *i)
        .collect();
    tok.decode(&picked).unwrap()
}

#[test]
fn kimi_k3_markers_are_single_ids_and_quoted_markers_are_text() {
    let tok = Tokenizer::load("kimi").unwrap();
    check_markers(ChatFormat::KimiK3, &tok).unwrap();
    let end = tok.token_id("<|end_of_msg|>").unwrap();
    let cases = golden(ChatFormat::KimiK3);
    for (name, chat, prompt, text) in &cases {
        let r = render(&chat.messages, &chat.tools, ChatFormat::KimiK3, *prompt).unwrap();
        let (ids, parts) = r.encode(&tok).unwrap();
        assert_eq!(ids.len(), parts.len());
        assert_eq!(&tok.decode(&ids).unwrap(), text, "{name}");
        // One <|end_of_msg|> id per message (the thinking-effort and tool-declare messages
        // included), however often people's text quotes it.
        let messages = chat.messages.len() + 1 + usize::from(!chat.tools.is_empty());
        assert_eq!(
            ids.iter().filter(|&&i| i == end).count(),
            messages,
            "{name}"
        );
    }
    let (_, chat, _, text) = &cases[2];
    assert_eq!(
        text.matches("<|end_of_msg|>").count(),
        5,
        "a user quotes it"
    );
    assert_eq!(chat.messages.len(), 3);
    // Who says what: the user's words and the tools' results are prompt; the reasoning with the
    // tag that closes it is thinking; the answer, the calls and the turn's close are the answer.
    let (_, chat, _, _) = &cases[3];
    let r = render(&chat.messages, &chat.tools, ChatFormat::KimiK3, false).unwrap();
    let (ids, parts) = r.encode(&tok).unwrap();
    let prompt = decoded(&tok, &ids, &parts, Part::Prompt);
    assert!(prompt.contains("Weather in Zürich for 3 days") && prompt.contains("12°C, clear"));
    assert!(
        prompt.starts_with("# Tools\n") && !prompt.contains("<|"),
        "{prompt}"
    );
    let thinking = decoded(&tok, &ids, &parts, Part::Thinking);
    assert_eq!(
        thinking,
        "Two calls at once.<|close|>think<|sep|>Both answered.<|close|>think<|sep|>"
    );
    let answer = decoded(&tok, &ids, &parts, Part::Answer);
    assert!(answer.starts_with(
        "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call \
         tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"\
         <|sep|>Zürich<|close|>argument<|sep|>"
    ));
    assert!(
        answer.ends_with(
            "see meteo.ch.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        )
    );
}

#[test]
fn kimi_k2_markers_are_single_ids_and_quoted_markers_are_text() {
    let tok = Tokenizer::load("kimi_k2").unwrap();
    check_markers(ChatFormat::KimiK2, &tok).unwrap();
    let end = tok.token_id("<|im_end|>").unwrap();
    let cases = golden(ChatFormat::KimiK2);
    for (name, chat, prompt, text) in &cases {
        let r = render(&chat.messages, &chat.tools, ChatFormat::KimiK2, *prompt).unwrap();
        let (ids, parts) = r.encode(&tok).unwrap();
        assert_eq!(ids.len(), parts.len());
        assert_eq!(&tok.decode(&ids).unwrap(), text, "{name}");
        // One <|im_end|> id per message (K2's default system turn and the tools' declaration
        // included), however often people's text quotes it.
        let default_system = usize::from(chat.messages[0].role != Role::System);
        let messages = chat.messages.len() + default_system + usize::from(!chat.tools.is_empty());
        assert_eq!(
            ids.iter().filter(|&&i| i == end).count(),
            messages,
            "{name}"
        );
    }
    let (name, _, _, text) = &cases[4];
    assert_eq!(name, "names_quoted_markers_and_results_of_no_call");
    assert_eq!(
        text.matches("<|im_end|>").count(),
        6,
        "the system quotes it"
    );
    // Who says what: the declarations, the user's words and the tools' results are prompt; the
    // reasoning in its tags is thinking; the answer, the calls and the turn's close are the answer.
    let (_, chat, _, _) = &cases[3];
    let r = render(&chat.messages, &chat.tools, ChatFormat::KimiK2, false).unwrap();
    let (ids, parts) = r.encode(&tok).unwrap();
    let prompt = decoded(&tok, &ids, &parts, Part::Prompt);
    assert!(
        prompt.contains("## Return of functions.search:1\n{\"results\""),
        "{prompt}"
    );
    assert!(prompt.starts_with("[{\"type\": \"function\"") && !prompt.contains("<|"));
    let thinking = decoded(&tok, &ids, &parts, Part::Thinking);
    assert_eq!(
        thinking,
        "<think>Two calls at once.</think><think>Check tomorrow too.</think>"
    );
    let answer = decoded(&tok, &ids, &parts, Part::Answer);
    assert!(answer.starts_with(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0\
         <|tool_call_argument_begin|>{\"city\": \"Zürich\""
    ));
    assert!(answer.ends_with(
        "functions.get_weather:2<|tool_call_argument_begin|>{\"city\": \"Zürich\", \"Days\": 1}\
         <|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    ));
    let section = tok.token_id("<|tool_calls_section_begin|>").unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == section).count(), 2);
}

#[test]
fn tool_calls_are_refused_where_a_format_cannot_write_them() {
    let (_, chat, _, _) = golden(ChatFormat::KimiK3).remove(3);
    // ChatML writes no speaker names, and a call's id only as the order of the results.
    let mut named = conversation();
    named[1].name = Some("ana".into());
    let e = render(&named, &[], ChatFormat::Chatml, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("message 1") && e.contains("`name`"), "{e}");
    let mut c = conversation();
    c[1].tool_calls = chat.messages[1].tool_calls.clone();
    let e = render(&c, &[], ChatFormat::KimiK3, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("message 1: only assistant turns call tools"),
        "{e}"
    );
    // A tool result with no name and no call to answer.
    let orphan = [
        Message::new(Role::User, "hi"),
        Message::new(Role::Tool, "42"),
    ];
    let e = render(&orphan, &[], ChatFormat::KimiK3, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("message 1: a tool result needs its tool's name"),
        "{e}"
    );
    // Arguments that are not a JSON object are refused when read.
    let line = r#"{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}"#;
    let e = Chat::from_record(line, "messages").unwrap_err();
    assert!(e.contains("arguments are not a JSON object"), "{e}");
}
