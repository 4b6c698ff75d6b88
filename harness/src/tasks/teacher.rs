//! An imperfect SFT teacher for `add`: it adds column by column like a person, but forgets each
//! carry with probability `p` (the forgotten carry is simply not added to the next column; a
//! forgotten final carry drops the leading `1`). Its answers are the SFT targets of a run with
//! `sft.carry_drop = p`, the common real pattern of supervised traces from a weaker model that RL
//! with a verifiable reward then corrects. The RL reward and every evaluation still use the true
//! answers: only the warm start's targets are affected.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::arith::parse_operands;
use super::{Problem, TaskError};

/// `a + b` computed column by column from the least significant digit, each carry kept with
/// probability `1 - p_drop` (one draw per carry that arises).
pub fn carry_dropping_sum(a: u128, b: u128, p_drop: f64, rng: &mut ChaCha8Rng) -> u128 {
    let (mut a, mut b) = (a, b);
    let (mut sum, mut place, mut carry) = (0u128, 1u128, 0u128);
    while a > 0 || b > 0 || carry > 0 {
        let s = a % 10 + b % 10 + carry;
        sum += (s % 10) * place;
        carry = s / 10;
        if carry > 0 && rng.random_bool(p_drop) {
            carry = 0;
        }
        a /= 10;
        b /= 10;
        place *= 10;
    }
    sum
}

/// Replaces the answers of `add` problems (`"{a}+{b}="`) with the carry-dropping teacher's, drawn
/// from `seed`; `reverse` writes them least-significant digit first like the task does. Returns
/// how many answers the teacher got wrong. A prompt not of that form is refused, naming it.
pub fn apply_carry_dropping_teacher(
    problems: &mut [Problem],
    p_drop: f64,
    reverse: bool,
    seed: u64,
) -> Result<usize, TaskError> {
    if !(0.0..=1.0).contains(&p_drop) {
        return Err(TaskError::BadOption {
            option: "carry_drop",
            reason: format!("{p_drop} (must be a probability in 0..=1)"),
        });
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(3);
    let mut wrong = 0;
    for p in problems.iter_mut() {
        let (a, b) = parse_operands(&p.prompt, '+').ok_or_else(|| {
            TaskError::BadProblem(format!(
                "prompt {:?} is not an addition a+b= (the carry-dropping teacher needs one)",
                p.prompt
            ))
        })?;
        let s = carry_dropping_sum(a, b, p_drop, &mut rng);
        wrong += usize::from(s != a + b);
        let text = s.to_string();
        p.answer = if reverse {
            text.chars().rev().collect()
        } else {
            text
        };
    }
    Ok(wrong)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::{AddTask, Split, generate, uniform_problems};

    #[test]
    fn never_dropping_is_exact_and_always_dropping_is_digitwise_mod_10() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for (a, b) in [
            (0, 0),
            (57, 68),
            (99, 99),
            (5, 5),
            (123_456, 987_654),
            (90, 10),
        ] {
            assert_eq!(carry_dropping_sum(a, b, 0.0, &mut rng), a + b);
        }
        // Every carry forgotten: each column is (a_i + b_i) mod 10.
        assert_eq!(carry_dropping_sum(57, 68, 1.0, &mut rng), 15);
        assert_eq!(carry_dropping_sum(99, 99, 1.0, &mut rng), 88);
        assert_eq!(carry_dropping_sum(5, 5, 1.0, &mut rng), 0);
        assert_eq!(carry_dropping_sum(90, 10, 1.0, &mut rng), 0);
        assert_eq!(carry_dropping_sum(12, 34, 1.0, &mut rng), 46);
    }

    #[test]
    fn a_single_carry_is_dropped_at_the_asked_rate() {
        // 5+5 has exactly one carry: the teacher answers 0 with probability p, else 10.
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let n = 20_000;
        let dropped = (0..n)
            .filter(|_| carry_dropping_sum(5, 5, 0.6, &mut rng) == 0)
            .count();
        let rate = dropped as f64 / n as f64;
        assert!((rate - 0.6).abs() < 0.015, "{rate}");
        // 57+68: two carries, both kept with probability 0.4 * 0.4.
        let exact = (0..n)
            .filter(|_| carry_dropping_sum(57, 68, 0.6, &mut rng) == 125)
            .count();
        let rate = exact as f64 / n as f64;
        assert!((rate - 0.16).abs() < 0.012, "{rate}");
    }

    #[test]
    fn the_teacher_rewrites_only_carry_problems_and_is_seeded() {
        let task = AddTask::new(2, 0.0, 100).unwrap().uniform_operands(true);
        let clean = generate(&task, 3, Split::Train, 2_000).unwrap();
        let mut a = clean.clone();
        let wrong = apply_carry_dropping_teacher(&mut a, 0.6, false, 9).unwrap();
        let mut b = clean.clone();
        apply_carry_dropping_teacher(&mut b, 0.6, false, 9).unwrap();
        assert_eq!(a, b);
        let mut changed = 0;
        for (p, q) in clean.iter().zip(&a) {
            let (x, y) = parse_operands(&p.prompt, '+').unwrap();
            let has_carry = x % 10 + y % 10 >= 10 || x + y >= 100;
            if q.answer != p.answer {
                changed += 1;
                assert!(has_carry, "{} -> {}", p.prompt, q.answer);
            }
        }
        assert_eq!(changed, wrong);
        // ~70% of uniform 2-digit sums carry; 60% of single carries (more of double) are lost.
        assert!((800..1_200).contains(&wrong), "{wrong} of 2000");
        let mut r = clean.clone();
        apply_carry_dropping_teacher(&mut r, 0.0, true, 9).unwrap();
        assert_eq!(
            r[0].answer,
            clean[0].answer.chars().rev().collect::<String>()
        );
    }

    #[test]
    fn bad_inputs_are_refused_with_the_reason() {
        let mut ps = uniform_problems('*', 2, false, 1, 3).unwrap();
        let e = apply_carry_dropping_teacher(&mut ps, 0.5, false, 0).unwrap_err();
        assert!(e.to_string().contains("not an addition"), "{e}");
        let mut ps = uniform_problems('+', 2, false, 1, 3).unwrap();
        let e = apply_carry_dropping_teacher(&mut ps, 1.5, false, 0).unwrap_err();
        assert!(e.to_string().contains("carry_drop"), "{e}");
    }
}
