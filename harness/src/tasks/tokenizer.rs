//! Tokenizers: text ↔ token ids. The built-in tasks use [`CharTokenizer`], one token per
//! character over a small fixed vocabulary, so a tiny model trains fast; real checkpoints bring
//! a Hugging Face `tokenizer.json`, loaded by [`HfTokenizer`] through the `tokenizers` crate.
//!
//! ## The character vocabulary (52 ids, fixed: model checkpoints depend on it)
//!
//! | ids    | tokens                                                    |
//! |--------|-----------------------------------------------------------|
//! | 0–2    | `<pad>`, `<bos>`, `<eos>`                                 |
//! | 3–12   | `0`–`9`                                                   |
//! | 13–25  | space `+ - * / = ( ) : > , . ?`                           |
//! | 26–51  | `a`–`z`                                                   |
//!
//! Anything else (upper case, tabs, non-ASCII) is an encoding error naming the character.

use std::fmt;
use std::path::Path;

/// Errors of encoding and decoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerError {
    /// A character the vocabulary does not have.
    UnknownChar {
        /// The character.
        ch: char,
        /// Its char index in the text.
        pos: usize,
    },
    /// A token id outside the vocabulary.
    UnknownId(u32),
    /// The `tokenizers` crate failed (loading, encoding or decoding).
    Hf(String),
}

impl fmt::Display for TokenizerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerError::UnknownChar { ch, pos } => {
                write!(
                    f,
                    "character {ch:?} at position {pos} is not in the character vocabulary"
                )
            }
            TokenizerError::UnknownId(id) => write!(f, "token id {id} is not in the vocabulary"),
            TokenizerError::Hf(e) => write!(f, "tokenizer: {e}"),
        }
    }
}

impl std::error::Error for TokenizerError {}

/// Text ↔ token ids.
pub trait Tokenizer: Send + Sync {
    /// Ids of `text`, without special tokens.
    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError>;
    /// Text of `ids`; special tokens are dropped.
    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError>;
    /// Number of ids (the model's vocabulary must be at least this large).
    fn vocab_size(&self) -> usize;
    /// Beginning-of-sequence id, if the vocabulary has one.
    fn bos_id(&self) -> Option<u32>;
    /// End-of-sequence id: generation stops on it and SFT targets end with it.
    fn eos_id(&self) -> Option<u32>;
    /// Padding id, if the vocabulary has one.
    fn pad_id(&self) -> Option<u32>;

    /// Ids of a prompt as the model sees it: `bos` (when there is one), then the text.
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids: Vec<u32> = self.bos_id().into_iter().collect();
        ids.extend(self.encode(text)?);
        Ok(ids)
    }
}

const CHAR_PAD: u32 = 0;
const CHAR_BOS: u32 = 1;
const CHAR_EOS: u32 = 2;
const CHAR_SPECIALS: u32 = 3;
/// The non-special characters in id order, starting at id 3.
const CHARS: &str = "0123456789 +-*/=():>,.?abcdefghijklmnopqrstuvwxyz";

/// One token per character over the fixed vocabulary in the module docs.
///
/// ```
/// use rolloutpipe_harness::tasks::{CharTokenizer, Tokenizer};
/// let t = CharTokenizer;
/// assert_eq!(t.encode("12+3=").unwrap(), vec![4, 5, 14, 6, 18]);
/// assert_eq!(t.decode(&[1, 4, 5, 2]).unwrap(), "12");
/// assert_eq!(t.vocab_size(), 52);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct CharTokenizer;

impl Tokenizer for CharTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        text.chars()
            .enumerate()
            .map(|(pos, ch)| {
                // The vocabulary is ASCII, so the byte offset from `find` is the char index.
                CHARS
                    .find(ch)
                    .map(|i| i as u32 + CHAR_SPECIALS)
                    .ok_or(TokenizerError::UnknownChar { ch, pos })
            })
            .collect()
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let chars = CHARS.as_bytes();
        let mut out = String::with_capacity(ids.len());
        for &id in ids {
            match id {
                CHAR_PAD | CHAR_BOS | CHAR_EOS => {}
                _ => match chars.get((id - CHAR_SPECIALS) as usize) {
                    Some(&b) => out.push(char::from(b)),
                    None => return Err(TokenizerError::UnknownId(id)),
                },
            }
        }
        Ok(out)
    }

    fn vocab_size(&self) -> usize {
        CHAR_SPECIALS as usize + CHARS.len()
    }
    fn bos_id(&self) -> Option<u32> {
        Some(CHAR_BOS)
    }
    fn eos_id(&self) -> Option<u32> {
        Some(CHAR_EOS)
    }
    fn pad_id(&self) -> Option<u32> {
        Some(CHAR_PAD)
    }
}

/// A Hugging Face `tokenizer.json`. Special ids come from `tokenizer_config.json` beside it
/// when present (`bos_token`, `eos_token`, `pad_token`), else from well-known special tokens.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .finish()
    }
}

/// Names used for end-of-sequence by common model families, most specific first.
const EOS_GUESSES: [&str; 4] = ["<|endoftext|>", "<|im_end|>", "</s>", "<eos>"];
const BOS_GUESSES: [&str; 2] = ["<s>", "<bos>"];
const PAD_GUESSES: [&str; 2] = ["<pad>", "[PAD]"];

impl HfTokenizer {
    /// Loads `tokenizer.json` (a file, or a model directory holding one).
    pub fn from_path(path: &Path) -> Result<Self, TokenizerError> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| TokenizerError::Hf(format!("cannot load {}: {e}", file.display())))?;
        let config = file.parent().map(|d| d.join("tokenizer_config.json"));
        let config: Option<serde_json::Value> = match config {
            Some(c) if c.exists() => {
                let text = std::fs::read_to_string(&c)
                    .map_err(|e| TokenizerError::Hf(format!("cannot read {}: {e}", c.display())))?;
                Some(
                    serde_json::from_str(&text)
                        .map_err(|e| TokenizerError::Hf(format!("{}: {e}", c.display())))?,
                )
            }
            _ => None,
        };
        let special = |key: &str, guesses: &[&str]| -> Option<u32> {
            // tokenizer_config.json writes a token either as a string or as {"content": ...}.
            let named = config.as_ref().and_then(|c| c.get(key)).and_then(|v| {
                v.as_str()
                    .or_else(|| v.get("content").and_then(|c| c.as_str()))
                    .map(str::to_owned)
            });
            match named {
                Some(name) => inner.token_to_id(&name),
                None => guesses.iter().find_map(|g| inner.token_to_id(g)),
            }
        };
        let bos = special("bos_token", &BOS_GUESSES);
        let eos = special("eos_token", &EOS_GUESSES);
        let pad = special("pad_token", &PAD_GUESSES);
        Ok(Self {
            inner,
            bos,
            eos,
            pad,
        })
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizerError::Hf(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }
    fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let size = self.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= size) {
            return Err(TokenizerError::UnknownId(bad));
        }
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Hf(e.to_string()))
    }
    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
    fn bos_id(&self) -> Option<u32> {
        self.bos
    }
    fn eos_id(&self) -> Option<u32> {
        self.eos
    }
    fn pad_id(&self) -> Option<u32> {
        self.pad
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn char_vocab_is_pinned() {
        let t = CharTokenizer;
        assert_eq!(t.encode("0").unwrap(), vec![3]);
        assert_eq!(t.encode(" ").unwrap(), vec![13]);
        assert_eq!(t.encode("?").unwrap(), vec![25]);
        assert_eq!(t.encode("az").unwrap(), vec![26, 51]);
        assert_eq!(
            t.encode_prompt("3 7>21:").unwrap(),
            vec![1, 6, 13, 10, 22, 5, 4, 21]
        );
        assert_eq!(
            t.encode("1A"),
            Err(TokenizerError::UnknownChar { ch: 'A', pos: 1 })
        );
        assert_eq!(t.decode(&[52]), Err(TokenizerError::UnknownId(52)));
    }

    proptest! {
        #[test]
        fn char_roundtrip(s in "[0-9 +*/=():>,.?a-z-]{0,40}") {
            let t = CharTokenizer;
            let ids = t.encode(&s).unwrap();
            prop_assert_eq!(ids.len(), s.len());
            prop_assert!(ids.iter().all(|&i| (3..52).contains(&i)));
            prop_assert_eq!(t.decode(&ids).unwrap(), s);
        }
    }

    /// A WordLevel tokenizer.json in the format `tokenizers` writes, with one special token.
    fn write_wordlevel(dir: &Path) {
        let vocab: serde_json::Map<String, serde_json::Value> =
            ["<|endoftext|>", "[UNK]", "the", "cat", "sat", "on", "mat"]
                .iter()
                .enumerate()
                .map(|(i, w)| ((*w).to_owned(), serde_json::json!(i)))
                .collect();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        std::fs::write(
            dir.join("tokenizer.json"),
            serde_json::to_string_pretty(&json).unwrap(),
        )
        .unwrap();
    }

    fn tempdir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("rolloutpipe-tok-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn hf_wordlevel_loads_encodes_decodes() {
        let dir = tempdir("wl");
        write_wordlevel(&dir);
        let t = HfTokenizer::from_path(&dir).unwrap();
        assert_eq!(t.vocab_size(), 7);
        assert_eq!(t.eos_id(), Some(0));
        assert_eq!(t.bos_id(), None);
        assert_eq!(
            t.encode("the cat sat on the mat").unwrap(),
            vec![2, 3, 4, 5, 2, 6]
        );
        assert_eq!(t.encode("the dog").unwrap(), vec![2, 1]);
        assert_eq!(t.decode(&[2, 3, 0]).unwrap(), "the cat");
        assert_eq!(t.decode(&[2, 99]), Err(TokenizerError::UnknownId(99)));
        // tokenizer_config.json overrides the guesses.
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": {"content": "mat"}, "pad_token": "[UNK]"}"#,
        )
        .unwrap();
        let t = HfTokenizer::from_path(&dir.join("tokenizer.json")).unwrap();
        assert_eq!((t.eos_id(), t.pad_id()), (Some(6), Some(1)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hf_bpe_applies_merges_in_rank_order() {
        let dir = tempdir("bpe");
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 6, "content": "</s>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Fuse"},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": {"1": 0, "2": 1, "+": 2, "12": 3, "12+": 4, "=": 5, "</s>": 6},
                      "merges": [["1", "2"], ["12", "+"]]}
        });
        std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
        let t = HfTokenizer::from_path(&dir).unwrap();
        // "12+" merges fully; the second "12" stops at rank 0 because "12=" is no merge.
        assert_eq!(t.encode("12+12=").unwrap(), vec![4, 3, 5]);
        assert_eq!(t.encode("21").unwrap(), vec![1, 0]);
        assert_eq!(t.decode(&[4, 3, 5, 6]).unwrap(), "12+12=");
        assert_eq!((t.eos_id(), t.vocab_size()), (Some(6), 7));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hf_bad_file_is_an_error() {
        let dir = tempdir("bad");
        std::fs::write(dir.join("tokenizer.json"), "{\"model\": 3}").unwrap();
        assert!(matches!(
            HfTokenizer::from_path(&dir),
            Err(TokenizerError::Hf(_))
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
