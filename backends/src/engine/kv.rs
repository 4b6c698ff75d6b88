//! Where the engine's requests keep their keys and values, on the host: which pages each
//! request's positions live in ([`KvStore`]), and so the engine's capacity.
//!
//! A request's page table lists the pages of its positions in order: position `j` lives at
//! KV row `table[j / page_rows] * page_rows + j % page_rows` of every layer. The device
//! memory behind the rows is the backend's; the store only hands pages out.
//!
//! - [`Paged`] (the CPU and wgpu backends): pages of [`PAGE`] positions, all of a request's
//!   handed out at admission, lowest ids first. A group's samples begin their tables with the
//!   same pages (the whole pages of its prompt before the last position), so the prefix is
//!   stored once and read by all.
//! - [`Slots`] (the CUDA backend, whose attention kernel reads each request's keys as one
//!   contiguous run): one page per request, as long as the longest request admitted, their
//!   number and length doubling as needed. Groups share nothing.

use std::collections::HashMap;

/// Positions per page of the [`Paged`] store.
pub const PAGE: usize = 16;

/// Pages needed for `positions` positions of [`PAGE`].
pub fn pages_for(positions: usize) -> usize {
    positions.div_ceil(PAGE)
}

/// A store of KV pages (see the module docs).
pub trait KvStore: std::fmt::Debug {
    /// One request's pages.
    type Lease: std::fmt::Debug;

    /// Positions per page.
    fn page_rows(&self) -> usize;
    /// Pages the device memory must hold: the highest page handed out so far, plus one.
    fn pages_used(&self) -> usize;
    /// Positions of a `samples`-sample group's `prompt`-token prompt stored once for all of
    /// them (0: none).
    fn shared(&self, prompt: usize, samples: usize) -> usize;
    /// Reserves `positions[i]` positions for each request of a submission, the first `shared`
    /// of them common to all (a group), all or nothing; the reason when they do not fit.
    fn reserve(
        &mut self,
        positions: &[usize],
        shared: usize,
    ) -> std::result::Result<Vec<Self::Lease>, String>;
    /// Frees a request's pages (a shared prefix's once no request holds it).
    fn release(&mut self, lease: &Self::Lease);
    /// Positions of the shared prefix `lease` reads (0: none).
    fn prefix_len(&self, lease: &Self::Lease) -> usize;
    /// Whether `lease`'s caller writes its shared prefix: true for the first caller, which
    /// prefills the whole prompt; the others compute only the positions past it.
    fn claim_prefix(&mut self, lease: &Self::Lease) -> bool;
    /// Positions of every live shared prefix.
    fn shared_positions(&self) -> usize;
    /// Appends `lease`'s page table to `out`.
    fn table(&self, lease: &Self::Lease, out: &mut Vec<u32>);
}

/// A group's shared prompt pages.
#[derive(Debug)]
struct Prefix {
    pages: Vec<u32>,
    len: usize,
    /// Requests still holding it.
    refs: usize,
    /// Whether a request was chosen to write it.
    filled: bool,
}

/// A request's pages in a [`Paged`] store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedLease {
    /// The group prefix whose pages hold positions `0..prefix.len` (`None`: none).
    prefix: Option<u64>,
    /// Pages of the positions past the prefix.
    own: Vec<u32>,
}

/// The paged store (see the module docs).
#[derive(Debug)]
pub struct Paged {
    max_pages: usize,
    /// Pages never handed out yet are `next..max_pages`; freed ones are in `free`.
    next: usize,
    free: Vec<u32>,
    prefixes: HashMap<u64, Prefix>,
    next_prefix: u64,
}

impl Paged {
    /// A store handing out at most `max_pages` pages.
    pub fn new(max_pages: usize) -> Self {
        Self {
            max_pages,
            next: 0,
            free: Vec::new(),
            prefixes: HashMap::new(),
            next_prefix: 0,
        }
    }

    /// Most pages the store hands out.
    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    /// Caps the store at `pages` pages, at most `device` (what the memory can hold). Refused
    /// below the highest page handed out so far.
    pub fn set_max_pages(
        &mut self,
        pages: usize,
        device: usize,
    ) -> std::result::Result<(), String> {
        if pages == 0 || pages > device || pages < self.next {
            return Err(format!(
                "{pages} is not within {}..={device} (pages in use .. what one binding holds)",
                self.next.max(1)
            ));
        }
        self.max_pages = pages;
        Ok(())
    }

    /// Pages that can still be handed out.
    pub fn free_pages(&self) -> usize {
        self.free.len() + (self.max_pages - self.next)
    }

    /// Hands out `n` pages (freed ones first, lowest first), or `None` when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free_pages() {
            return None;
        }
        let from_free = n.min(self.free.len());
        let mut out: Vec<u32> = self.free.drain(..from_free).collect();
        let fresh = n - from_free;
        out.extend((self.next..self.next + fresh).map(|p| p as u32));
        self.next += fresh;
        Some(out)
    }

    /// Returns pages.
    fn give_back(&mut self, pages: &[u32]) {
        self.free.extend_from_slice(pages);
        self.free.sort_unstable();
    }
}

impl KvStore for Paged {
    type Lease = PagedLease;

    fn page_rows(&self) -> usize {
        PAGE
    }

    fn pages_used(&self) -> usize {
        self.next
    }

    fn shared(&self, prompt: usize, samples: usize) -> usize {
        // The whole pages before the prompt's last position, whose logits each sample needs.
        if samples < 2 {
            return 0;
        }
        (prompt.saturating_sub(1) / PAGE) * PAGE
    }

    fn reserve(
        &mut self,
        positions: &[usize],
        shared: usize,
    ) -> std::result::Result<Vec<PagedLease>, String> {
        let own: Vec<usize> = positions.iter().map(|p| pages_for(p - shared)).collect();
        let need = pages_for(shared) + own.iter().sum::<usize>();
        if need > self.free_pages() {
            return Err(format!(
                "{} request(s) need {need} KV pages of {PAGE} positions, {} of the pool's {} are free",
                positions.len(),
                self.free_pages(),
                self.max_pages
            ));
        }
        let prefix = (shared > 0).then(|| {
            let pages = self.alloc(pages_for(shared)).unwrap_or_default();
            let id = self.next_prefix;
            self.next_prefix += 1;
            let p = Prefix {
                pages,
                len: shared,
                refs: positions.len(),
                filled: false,
            };
            self.prefixes.insert(id, p);
            id
        });
        Ok(own
            .into_iter()
            .map(|n| PagedLease {
                prefix,
                own: self.alloc(n).unwrap_or_default(),
            })
            .collect())
    }

    fn release(&mut self, lease: &PagedLease) {
        self.give_back(&lease.own);
        if let Some(id) = lease.prefix
            && let Some(p) = self.prefixes.get_mut(&id)
        {
            p.refs -= 1;
            if p.refs == 0
                && let Some(p) = self.prefixes.remove(&id)
            {
                self.give_back(&p.pages);
            }
        }
    }

    fn prefix_len(&self, lease: &PagedLease) -> usize {
        lease
            .prefix
            .and_then(|id| self.prefixes.get(&id))
            .map_or(0, |p| p.len)
    }

    fn claim_prefix(&mut self, lease: &PagedLease) -> bool {
        match lease.prefix.and_then(|id| self.prefixes.get_mut(&id)) {
            Some(p) if !p.filled => {
                p.filled = true;
                true
            }
            _ => false,
        }
    }

    fn shared_positions(&self) -> usize {
        self.prefixes.values().map(|p| p.len).sum()
    }

    fn table(&self, lease: &PagedLease, out: &mut Vec<u32>) {
        if let Some(p) = lease.prefix.and_then(|id| self.prefixes.get(&id)) {
            out.extend_from_slice(&p.pages);
        }
        out.extend_from_slice(&lease.own);
    }
}

/// A request's slot in a [`Slots`] store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot(u32);

/// The slot store (see the module docs).
#[derive(Debug)]
pub struct Slots {
    slots: usize,
    rows: usize,
    free: Vec<u32>,
    max_pos: usize,
}

impl Slots {
    /// An empty store for requests of at most `max_pos` positions.
    pub fn new(max_pos: usize) -> Self {
        Self {
            slots: 0,
            rows: 0,
            free: Vec::new(),
            max_pos,
        }
    }

    /// Grows (never shrinks) the geometry for one more request of `need` positions: slots
    /// start sized for the longest request seen (not the position limit, which can be 40k)
    /// and double when none is free.
    fn grow(&mut self, need: usize) {
        if need > self.rows {
            self.rows = need.next_power_of_two().clamp(64, self.max_pos.max(need));
        }
        if self.free.is_empty() {
            let slots = (self.slots * 2).max(16);
            // Lower slots are handed out first (popped from the end).
            self.free
                .extend((self.slots..slots).rev().map(|s| s as u32));
            self.slots = slots;
        }
    }
}

impl KvStore for Slots {
    type Lease = Slot;

    fn page_rows(&self) -> usize {
        self.rows
    }

    fn pages_used(&self) -> usize {
        self.slots
    }

    fn shared(&self, _prompt: usize, _samples: usize) -> usize {
        0
    }

    fn reserve(
        &mut self,
        positions: &[usize],
        _shared: usize,
    ) -> std::result::Result<Vec<Slot>, String> {
        let mut out = Vec::with_capacity(positions.len());
        for &need in positions {
            self.grow(need);
            out.push(Slot(self.free.pop().unwrap_or_default()));
        }
        Ok(out)
    }

    fn release(&mut self, lease: &Slot) {
        self.free.push(lease.0);
    }

    fn prefix_len(&self, _lease: &Slot) -> usize {
        0
    }

    fn claim_prefix(&mut self, _lease: &Slot) -> bool {
        false
    }

    fn shared_positions(&self) -> usize {
        0
    }

    fn table(&self, lease: &Slot, out: &mut Vec<u32>) {
        out.push(lease.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_handed_out_lowest_first_and_refused_past_capacity() {
        let mut p = Paged::new(5);
        assert_eq!(p.alloc(2), Some(vec![0, 1]));
        assert_eq!(p.alloc(2), Some(vec![2, 3]));
        assert_eq!(p.alloc(2), None);
        p.give_back(&[3, 0]);
        assert_eq!(p.free_pages(), 3);
        assert_eq!(p.alloc(3), Some(vec![0, 3, 4]));
        assert_eq!(p.free_pages(), 0);
        assert_eq!(pages_for(16), 1);
        assert_eq!(pages_for(17), 2);
    }

    #[test]
    fn a_group_prefix_is_stored_once_written_once_and_freed_with_its_last_sample() {
        let mut p = Paged::new(64);
        // A 40-token prompt: its first 32 positions are two whole pages before the last one.
        let shared = p.shared(40, 3);
        assert_eq!((shared, p.shared(40, 1), p.shared(16, 3)), (32, 0, 0));
        let leases = p.reserve(&[45, 41, 50], shared).unwrap();
        // 2 prefix pages, then 1 + 1 + 2 own pages.
        assert_eq!(p.pages_used(), 6);
        assert_eq!(p.shared_positions(), 32);
        let mut t = Vec::new();
        p.table(&leases[2], &mut t);
        assert_eq!(t, [0, 1, 4, 5]);
        assert!(p.claim_prefix(&leases[1]) && !p.claim_prefix(&leases[0]));
        p.release(&leases[0]);
        p.release(&leases[1]);
        assert_eq!(p.shared_positions(), 32);
        p.release(&leases[2]);
        assert_eq!((p.shared_positions(), p.free_pages()), (0, 64));
        let e = Paged::new(2).reserve(&[40], 0).unwrap_err();
        assert!(e.contains("need 3 KV pages"), "{e}");
    }

    #[test]
    fn kv_slots_grow_by_doubling_and_to_the_longest_request() {
        let mut s = Slots::new(512);
        // First request: 16 slots of 64 rows; lowest slot first.
        assert_eq!(s.reserve(&[10], 0).unwrap(), [Slot(0)]);
        assert_eq!((s.pages_used(), s.page_rows()), (16, 64));
        // Longer than a slot: rows to the next power of two, capped at the position limit
        // unless the request itself is longer.
        s.reserve(&[65], 0).unwrap();
        assert_eq!(s.page_rows(), 128);
        Slots::new(256).reserve(&[300], 0).unwrap();
        let mut long = Slots::new(256);
        long.reserve(&[300], 0).unwrap();
        assert_eq!(long.page_rows(), 300);
        // No free slot: double.
        s.reserve(&[1; 14], 0).unwrap();
        assert_eq!(s.pages_used(), 16);
        s.reserve(&[1], 0).unwrap();
        assert_eq!(s.pages_used(), 32);
    }
}
