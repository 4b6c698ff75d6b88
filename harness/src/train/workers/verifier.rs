//! The verifier worker: [`score`] is its work, shared by the in-process thread
//! ([`verifier_thread`]) and the remote `VerifierHost`.
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::tasks::{Problem, Task, Tokenizer};
use crate::train::msg::{Event, Score, VerifyJob};

/// Reward and correctness of a response; undecodable tokens count as a malformed answer.
pub fn score(task: &dyn Task, tok: &dyn Tokenizer, p: &Problem, tokens: &[u32]) -> (f32, bool) {
    match tok.decode(tokens) {
        Ok(text) => {
            let text = text.trim();
            (task.reward(p, text), task.verify(p, text).is_correct())
        }
        Err(_) => (-task.format_penalty(), false),
    }
}

/// Runs one verifier until the job channel closes.
pub fn verifier_thread(
    task: Arc<dyn Task>,
    tokenizer: Arc<dyn Tokenizer>,
    jobs: Arc<Mutex<Receiver<VerifyJob>>>,
    events: Sender<Event>,
) {
    loop {
        let job = {
            let Ok(rx) = jobs.lock() else { return };
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        let _ = events.send(Event::Rewarded(verify(
            task.as_ref(),
            tokenizer.as_ref(),
            &job,
        )));
    }
}

/// Scores one job, timed.
pub fn verify(task: &dyn Task, tok: &dyn Tokenizer, job: &VerifyJob) -> Score {
    let t = Instant::now();
    let (reward, correct) = score(task, tok, &job.problem, &job.tokens);
    Score {
        rid: job.rid,
        reward,
        correct,
        secs: t.elapsed().as_secs_f64(),
    }
}
