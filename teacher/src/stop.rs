//! OpenAI's `stop` strings: an answer ends before the first its text holds. The ids that wrote
//! it are kept (as vLLM keeps them, with their logprobs); the text is cut before it. The models
//! are not stopped early: an answer is cut once written.

use crate::wire::openai::Stop;

/// The most stop strings a request may give, and the longest.
pub const MAX_STOPS: usize = 16;
pub const MAX_STOP_BYTES: usize = 1024;

/// A request's `stop` strings, checked: why not, for a 400 naming `stop`.
pub fn stop_strings(stop: Option<&Stop>) -> Result<Vec<String>, String> {
    let strings = stop.map(Stop::strings).unwrap_or_default();
    if strings.len() > MAX_STOPS
        || strings
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(format!(
            "`stop` takes at most {MAX_STOPS} strings, each of 1 to {MAX_STOP_BYTES} bytes"
        ));
    }
    Ok(strings)
}

/// Where `text` first holds one of `stops`: the byte it starts at, and the byte it ends at.
pub fn first_stop(text: &str, stops: &[String]) -> Option<(usize, usize)> {
    stops
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| (at, at + s.len())))
        .min()
}

/// `text` ended before the first of `stops` it holds.
pub fn cut_text(mut text: String, stops: &[String]) -> String {
    if let Some((at, _)) = first_stop(&text, stops) {
        text.truncate(at);
    }
    text
}

/// How many of `ids` to keep: a prefix whose text (`decode`) holds a stop string where the one
/// before it does not, or None when the whole text holds none. Found by bisection, log₂ n decodes
/// rather than n; where a prefix's text is a prefix of the whole (byte-level BPE, but for a
/// character cut in two) it is the fewest such ids.
pub fn cut_at_stop(
    ids: &[u32],
    stops: &[String],
    decode: impl Fn(&[u32]) -> String,
) -> Option<usize> {
    if stops.is_empty() {
        return None;
    }
    first_stop(&decode(ids), stops)?;
    let (mut lo, mut hi) = (0, ids.len());
    // The first `lo` ids hold none; the first `hi` hold one.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match first_stop(&decode(&ids[..mid]), stops) {
            Some(_) => hi = mid,
            None => lo = mid,
        }
    }
    Some(hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_cut_at_its_first_stop_string() {
        // One character an id.
        let decode = |ids: &[u32]| ids.iter().map(|&i| char::from(b'a' + i as u8)).collect();
        let ids: Vec<u32> = (0..10).collect(); // "abcdefghij"
        let stops = vec!["ghi".to_string(), "de".to_string()];
        assert_eq!(first_stop("abcdefghij", &stops), Some((3, 5)));
        assert_eq!(cut_text("abcdefghij".into(), &stops), "abc");
        assert_eq!(cut_at_stop(&ids, &stops, decode), Some(5));
        for n in 1..=10 {
            // A stop string the n-th id completes is found there, wherever n is.
            let stop = vec![char::from(b'a' + n as u8 - 1).to_string()];
            assert_eq!(cut_at_stop(&ids, &stop, decode), Some(n));
        }
        assert_eq!(cut_at_stop(&ids, &["xyz".into()], decode), None);
        assert_eq!(cut_at_stop(&ids, &[], decode), None);
        assert!(stop_strings(Some(&Stop::One(String::new()))).is_err());
        assert!(stop_strings(Some(&Stop::Many(vec!["a".into(); 17]))).is_err());
        assert_eq!(
            stop_strings(Some(&Stop::Many(vec!["\n\n".into()]))).unwrap(),
            ["\n\n"]
        );
    }
}
