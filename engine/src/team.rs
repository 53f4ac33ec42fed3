//! The compute team: the threads that share one step's products, attention and sampling.
//!
//! A decode step is a few hundred short parallel loops (four products a layer, each well under a
//! millisecond at one stream). A pool whose idle threads sleep pays a wake-up at each of them (a
//! futex call, then the kernel's scheduling latency), and on two cores that was a fifth of a
//! step. The team's threads instead poll for the next loop for a while after each one ([`SPIN`];
//! on a busy engine the next loop comes much sooner), first in a tight loop, then yielding the
//! core at each poll so that the async runtime's threads still get it, and only then sleep. The
//! calling thread takes tasks too: a team of `n` threads starts `n - 1` of its own.
//!
//! A loop is [`for_each`]`(tasks, f)`: every index in `0..tasks` runs `f` exactly once, on some
//! thread of the team, and the call returns when all have ended. A panic in a task is resumed in
//! the caller, after every task has ended. One loop runs at a time: a call made from inside a
//! task, or from another thread while a loop runs, runs its tasks itself, in order.
//!
//! Protocol: the caller writes the job, sets `open` and bumps `epoch`; a thread joins by raising
//! `helpers` and then reading `open`; the caller clears `open` once every task is claimed and
//! waits for `helpers` to fall to zero before it returns (the job lives on its stack). A thread
//! that raised `helpers` after `open` was cleared sees it cleared (both sequentially
//! consistent) and leaves without reading the job.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle thread polls for the next loop before it sleeps.
const SPIN: Duration = Duration::from_millis(1);
/// How long of that it polls without giving the core away.
const TIGHT: Duration = Duration::from_micros(50);

/// Runs `f(i)` for every `i` in `0..tasks` on the team installed on this thread (see
/// [`Team::install`]), or on a team of all the machine's cores when none is.
pub fn for_each(tasks: usize, f: impl Fn(usize) + Sync) {
    CURRENT.with(|current| match current.get() {
        // SAFETY: `install` keeps the team alive, and the pointer set, only for its scope.
        Some(team) => unsafe { &*team }.for_each(tasks, &f),
        None => global().for_each(tasks, &f),
    })
}

/// Runs `f` on every item, each on some thread of the team (as [`for_each`]).
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(&mut T) + Sync) {
    let base = SendPtr::new(items);
    // SAFETY: each index is handed to exactly one task, so no two references alias.
    for_each(items.len(), |i| f(unsafe { &mut *base.get().add(i) }));
}

/// The team of every core's threads, started at first use.
fn global() -> &'static Team {
    static GLOBAL: OnceLock<Team> = OnceLock::new();
    GLOBAL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Without threads of its own a team still runs every loop, on the caller.
        Team::new(threads).unwrap_or_else(|_| Team::new(1).expect("a team of one starts no thread"))
    })
}

thread_local! {
    static CURRENT: Cell<Option<*const Team>> = const { Cell::new(None) };
}

/// A team of threads; see the module documentation.
pub struct Team {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Team {
    /// A team of `threads` (at least one: the caller), `threads - 1` of them started here.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let mut team = Self {
            shared: Arc::new(Shared::default()),
            threads: Vec::new(),
        };
        for i in 1..threads.max(1) {
            let shared = team.shared.clone();
            let thread = std::thread::Builder::new()
                .name(format!("swarmgate-compute-{i}"))
                .spawn(move || shared.work())?;
            team.threads.push(thread);
        }
        Ok(team)
    }

    /// Threads in the team, the caller's included.
    pub fn threads(&self) -> usize {
        self.threads.len() + 1
    }

    /// Runs `f` with this team as the one [`for_each`] uses on this thread.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore(Option<*const Team>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|current| current.set(self.0));
            }
        }
        let _restore = Restore(CURRENT.with(|current| current.replace(Some(self))));
        f()
    }

    fn for_each(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        if tasks <= 1 || self.threads.is_empty() || !s.acquire() {
            (0..tasks).for_each(f);
            return;
        }
        // SAFETY: only the caller holding `busy` writes the job, while `open` is clear and no
        // thread is inside it (the previous caller waited for `helpers` to reach zero).
        unsafe {
            *s.job.get() = Job {
                f: std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(
                    f,
                ),
                tasks,
            }
        };
        s.next.0.store(0, Ordering::Relaxed);
        // Open before the new epoch: a thread that sees the epoch finds the job open.
        s.open.store(true, Ordering::SeqCst);
        s.epoch.0.fetch_add(1, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _sleepers = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let own = panic::catch_unwind(AssertUnwindSafe(|| s.run()));
        s.open.store(false, Ordering::SeqCst);
        while s.helpers.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        let theirs = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        s.busy.store(false, Ordering::Release);
        if let Some(payload) = own.err().or(theirs) {
            panic::resume_unwind(payload);
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _sleepers = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// The loop being run: its tasks, borrowed from the caller's stack for the loop's duration.
#[derive(Clone, Copy)]
struct Job {
    f: &'static (dyn Fn(usize) + Sync),
    tasks: usize,
}

struct Shared {
    job: UnsafeCell<Job>,
    /// Held by the caller running a loop.
    busy: AtomicBool,
    /// Raised with each loop, so a thread joins each loop at most once. (Polled by the idle
    /// threads: kept off the lines that claiming tasks writes.)
    epoch: Padded<AtomicUsize>,
    /// Set while the loop has tasks to claim.
    open: AtomicBool,
    /// The next task to claim.
    next: Padded<AtomicUsize>,
    /// Threads inside the job.
    helpers: AtomicUsize,
    /// The first panic of a team thread's task in this loop.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

// SAFETY: `job` is written only by the caller holding `busy` while no thread reads it (see
// `Team::for_each`); everything else is atomics and locks.
unsafe impl Sync for Shared {}

impl Default for Shared {
    fn default() -> Self {
        Self {
            job: UnsafeCell::new(Job {
                f: &|_| {},
                tasks: 0,
            }),
            busy: AtomicBool::new(false),
            epoch: Padded(AtomicUsize::new(0)),
            open: AtomicBool::new(false),
            next: Padded(AtomicUsize::new(0)),
            helpers: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        }
    }
}

impl Shared {
    fn acquire(&self) -> bool {
        self.busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// Claims and runs the open job's tasks until none is left.
    fn run(&self) {
        // SAFETY: called with the job open and this thread counted in `helpers` (or the
        // caller's own), so the job is the caller's and stays valid.
        let job = unsafe { *self.job.get() };
        loop {
            let i = self.next.0.fetch_add(1, Ordering::Relaxed);
            if i >= job.tasks {
                return;
            }
            (job.f)(i);
        }
    }

    /// A team thread's life: join each loop, poll for the next, sleep when none comes.
    fn work(&self) {
        // No loop seen yet: one already open when the thread starts is joined too.
        let mut seen = 0;
        let mut idle = Instant::now();
        let mut polls = 0u32;
        while !self.stop.load(Ordering::Relaxed) {
            let epoch = self.epoch.0.load(Ordering::Acquire);
            if epoch != seen {
                seen = epoch;
                self.helpers.fetch_add(1, Ordering::SeqCst);
                if self.open.load(Ordering::SeqCst) {
                    if let Err(payload) = panic::catch_unwind(AssertUnwindSafe(|| self.run())) {
                        let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                        first.get_or_insert(payload);
                    }
                }
                self.helpers.fetch_sub(1, Ordering::SeqCst);
                idle = Instant::now();
                polls = 0;
                continue;
            }
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let waited = idle.elapsed();
            if waited < TIGHT {
                std::hint::spin_loop();
            } else if waited < SPIN {
                std::thread::yield_now();
            } else {
                let guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.sleeping.fetch_add(1, Ordering::SeqCst);
                if self.epoch.0.load(Ordering::SeqCst) == seen && !self.stop.load(Ordering::SeqCst)
                {
                    drop(self.wake.wait(guard).unwrap_or_else(|e| e.into_inner()));
                }
                self.sleeping.fetch_sub(1, Ordering::SeqCst);
                idle = Instant::now();
            }
        }
    }
}

/// A value on cache lines of its own.
#[repr(align(128))]
struct Padded<T>(T);

/// A pointer into a slice whose disjoint parts tasks write.
pub(crate) struct SendPtr<T>(*mut T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}

// SAFETY: users hand each part of the slice to one task only.
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    pub(crate) fn new(slice: &mut [T]) -> Self {
        Self(slice.as_mut_ptr())
    }

    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once_on_several_threads() {
        let team = Team::new(3).unwrap();
        for tasks in [0, 1, 2, 7, 1000] {
            let counts: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            team.install(|| for_each(tasks, |i| _ = counts[i].fetch_add(1, Ordering::Relaxed)));
            assert!(
                counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                "{tasks} tasks"
            );
        }
        // The caller's tasks wait (for at most a few seconds) until another thread takes one.
        let caller = std::thread::current().id();
        let helped = AtomicBool::new(false);
        team.install(|| {
            for_each(64, |_| {
                if std::thread::current().id() != caller {
                    helped.store(true, Ordering::SeqCst);
                    return;
                }
                let until = Instant::now() + Duration::from_secs(5);
                while !helped.load(Ordering::SeqCst) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        });
        assert!(helped.into_inner(), "the team's threads took no task");
    }

    #[test]
    fn nested_and_concurrent_loops_run_their_tasks() {
        let team = Team::new(2).unwrap();
        let sum = AtomicUsize::new(0);
        team.install(|| {
            for_each(8, |i| {
                for_each(8, |j| _ = sum.fetch_add(i * 8 + j, Ordering::Relaxed))
            })
        });
        assert_eq!(sum.load(Ordering::Relaxed), (0..64).sum::<usize>());
        let team = &team;
        let sums: Vec<usize> = std::thread::scope(|scope| {
            let runs: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(move || {
                        let sum = AtomicUsize::new(0);
                        for _ in 0..200 {
                            team.install(|| {
                                for_each(10, |i| _ = sum.fetch_add(i, Ordering::Relaxed))
                            });
                        }
                        sum.into_inner()
                    })
                })
                .collect();
            runs.into_iter().map(|r| r.join().unwrap()).collect()
        });
        assert_eq!(sums, vec![45 * 200; 4]);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_after_the_others_end() {
        let team = Team::new(2).unwrap();
        let ended = AtomicUsize::new(0);
        let caught = panic::catch_unwind(AssertUnwindSafe(|| {
            team.install(|| {
                for_each(100, |i| {
                    if i == 50 {
                        panic!("task 50");
                    }
                    std::thread::sleep(Duration::from_micros(100));
                    ended.fetch_add(1, Ordering::Relaxed);
                })
            })
        }));
        let payload = caught.expect_err("the panic was lost");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"task 50"));
        let after = ended.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            ended.load(Ordering::Relaxed),
            after,
            "a task ran after the loop returned"
        );
        // The team still works, its threads included, after sleeping past the spin.
        std::thread::sleep(SPIN * 3);
        let mut items = vec![0u64; 500];
        team.install(|| for_each_mut(&mut items, |x| *x += 1));
        assert!(items.iter().all(|&x| x == 1));
    }
}
