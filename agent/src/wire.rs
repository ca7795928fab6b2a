//! What the gateway reads beyond OpenAI's requests (the teacher's wire types, which `teacher
//! serve` shares with k3mini's clients), and how it reads them: a field it does not serve is
//! refused by name, never ignored.

use k3mini_http::{ApiError, bad};
use k3mini_teacher::wire::parse_request_naming_unknown;
use serde::Deserialize;

/// The k3mini extension to `/v1/completions`: tests the completion must pass (HumanEval's `test`
/// and `entry_point`), run in the sandbox under a policy whose `[gate] run_tests` is on.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodeTests {
    pub tests: String,
    pub entry_point: String,
}

/// The field [`CodeTests`] arrive in, read apart from OpenAI's.
#[derive(Deserialize)]
struct WithTests {
    k3mini_tests: CodeTests,
}

/// The extension fields a request may carry beside OpenAI's (completions only).
pub const EXTENSIONS: [&str; 1] = ["k3mini_tests"];

/// A request body as `T`, with its `k3mini_tests` where `T` is a completion that carries them;
/// any other field `T` does not know is refused by name.
pub fn parse<T: serde::de::DeserializeOwned>(
    body: &[u8],
    extensions: &[&str],
) -> Result<(T, Option<CodeTests>), ApiError> {
    let named = |(param, message): (String, String)| bad(&param, message);
    let (value, unknown) = parse_request_naming_unknown::<T>(body).map_err(named)?;
    let (ours, foreign): (Vec<String>, Vec<String>) = unknown
        .into_iter()
        .partition(|f| extensions.contains(&f.as_str()));
    if let Some(first) = foreign.first() {
        return Err(bad(
            first,
            format!(
                "the agent gateway does not serve {}: refused rather than ignored",
                foreign
                    .iter()
                    .map(|f| format!("`{f}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let tests = match ours.is_empty() {
        true => None,
        false => Some(
            parse_request_naming_unknown::<WithTests>(body)
                .map_err(named)?
                .0
                .k3mini_tests,
        ),
    };
    Ok((value, tests))
}
