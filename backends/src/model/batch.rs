//! A batch of sequences packed into token rows, as every backend's training forward reads it.
//!
//! Sequences are concatenated into `n` rows so that every projection is one product over all
//! tokens (llm.c's `B×T`, without padding); attention keeps to each sequence's rows. Only
//! the rows that predict a scored token reach the lm_head, so prompts cost no lm_head work.

use std::ops::Range;

/// Sequences packed into token rows, with the rows whose logits are needed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Packed {
    /// Token ids of all sequences, concatenated.
    pub ids: Vec<u32>,
    /// Position of each token within its sequence.
    pub pos: Vec<u32>,
    /// Row range of each sequence.
    pub seqs: Vec<Range<usize>>,
    /// Rows whose logits are computed (the position before each scored token).
    pub rows: Vec<u32>,
    /// The token each selected row predicts.
    pub targets: Vec<u32>,
}

impl Packed {
    /// Packs `(prompt, response)` pairs; the selected rows predict every response token.
    pub fn scored(seqs: &[(&[u32], &[u32])]) -> Self {
        let mut b = Self::default();
        for (prompt, response) in seqs {
            let start = b.ids.len();
            b.ids.extend_from_slice(prompt);
            b.ids.extend_from_slice(response);
            let n = prompt.len() + response.len();
            b.pos.extend(0..n as u32);
            for (t, tok) in response.iter().enumerate() {
                b.rows.push((start + prompt.len() + t - 1) as u32);
                b.targets.push(*tok);
            }
            b.seqs.push(start..start + n);
        }
        b
    }

    /// One sequence whose logits are wanted at every position (targets are unused zeros).
    // One sequence is exactly a one-element list of row ranges here.
    #[allow(clippy::single_range_in_vec_init)]
    pub fn all_positions(ids: &[u32]) -> Self {
        let n = ids.len();
        Self {
            ids: ids.to_vec(),
            pos: (0..n as u32).collect(),
            seqs: vec![0..n],
            rows: (0..n as u32).collect(),
            targets: vec![0; n],
        }
    }

    /// Token rows.
    pub fn n(&self) -> usize {
        self.ids.len()
    }

    /// Scored rows.
    pub fn m(&self) -> usize {
        self.rows.len()
    }

    /// `(start, pos)` per row: the row attends key rows `start ..= start + pos` (the device
    /// attention kernels' query metadata).
    pub fn qmeta(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(2 * self.n());
        for s in &self.seqs {
            for t in 0..s.len() {
                out.extend([s.start as u32, t as u32]);
            }
        }
        out
    }

    /// `(start, len)` per row: its sequence (the device attention backward's row metadata).
    pub fn rowmeta(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(2 * self.n());
        for s in &self.seqs {
            out.extend((0..s.len()).flat_map(|_| [s.start as u32, s.len() as u32]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_rows_and_attention_windows() {
        let (p1, r1, p2, r2) = ([1u32, 2, 3], [4u32, 5], [6u32], [7u32, 8, 9]);
        let b = Packed::scored(&[(&p1, &r1), (&p2, &r2)]);
        assert_eq!(b.ids, [1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(b.pos, [0, 1, 2, 3, 4, 0, 1, 2, 3]);
        assert_eq!(b.seqs, [0..5, 5..9]);
        // Row 2 predicts 4, row 5 (the second prompt's only token) predicts 7.
        assert_eq!(b.rows, [2, 3, 5, 6, 7]);
        assert_eq!(b.targets, [4, 5, 7, 8, 9]);
        // Row 6 (the second sequence's second token) attends rows 5..=6.
        assert_eq!(&b.qmeta()[12..14], &[5, 1]);
        assert_eq!(&b.rowmeta()[12..14], &[5, 4]);
        let a = Packed::all_positions(&[3, 1, 2]);
        assert_eq!(a.qmeta(), vec![0, 0, 0, 1, 0, 2]);
        assert_eq!(a.rowmeta(), vec![0, 3, 0, 3, 0, 3]);
        assert_eq!((a.n(), a.m()), (3, 3));
    }
}
