//! Chat templates: the exact strings of ChatML and Kimi, special tokens as single ids, and parts that
//! put each token in the prompt, the thinking or the answer.
use k3mini_data::chat::{Part, check_markers, render};
use k3mini_data::{ChatFormat, LossParts, Message, Role, Tokenizer};

fn conversation() -> Vec<Message> {
    let m = |role, content: &str, thinking: Option<&str>| Message {
        role,
        content: content.into(),
        thinking: thinking.map(Into::into),
    };
    vec![
        m(Role::System, "You are terse.", None),
        m(Role::User, "What is 2+3?", None),
        m(Role::Assistant, "5", Some("2 plus 3 is 5.")),
    ]
}

#[test]
fn chatml_renders_like_qwen3_and_smollm2() {
    let r = render(&conversation(), ChatFormat::Chatml, false).unwrap();
    assert_eq!(
        r.text(),
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n\
         <|im_start|>assistant\n<think>\n2 plus 3 is 5.\n</think>\n\n5<|im_end|>\n"
    );
    let prompt = render(&conversation()[..2], ChatFormat::Chatml, true).unwrap();
    assert!(
        prompt
            .text()
            .ends_with("<|im_end|>\n<|im_start|>assistant\n")
    );
}

#[test]
fn kimi_renders_its_turn_markers() {
    let r = render(&conversation(), ChatFormat::Kimi, false).unwrap();
    assert_eq!(
        r.text(),
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|><|im_user|>user<|im_middle|>What is 2+3?\
         <|im_end|><|im_assistant|>assistant<|im_middle|><think>2 plus 3 is 5.</think>5<|im_end|>"
    );
}

#[test]
fn kimi_tokens_carry_their_part() {
    // The Kimi template's markers are K2's (K3's vocabulary renames them).
    let tok = Tokenizer::load("kimi_k2").unwrap();
    check_markers(ChatFormat::Kimi, &tok).unwrap();
    let k3 = Tokenizer::load("kimi").unwrap();
    let e = check_markers(ChatFormat::Kimi, &k3).unwrap_err();
    let e = e.to_string();
    assert!(e.contains("<|im_system|>") && e.contains("kimi_k2"), "{e}");
    let r = render(&conversation(), ChatFormat::Kimi, false).unwrap();
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
        render(&[], ChatFormat::Kimi, false)
            .unwrap_err()
            .to_string()
            .contains("no messages")
    );
    let mut c = conversation();
    c[1].thinking = Some("x".into());
    assert!(
        render(&c, ChatFormat::Chatml, false)
            .unwrap_err()
            .to_string()
            .contains("message 1: only assistant turns carry thinking")
    );
}
