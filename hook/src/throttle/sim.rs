//! A discrete-event simulation of the GPU and of the jobs that drive it, on a virtual clock, running
//! the limiter's own accounting: the shared bucket ([`bucket`]), the per-key estimates and sampling
//! ([`Estimates`]) and the overlap factor ([`overlap::Window`]). What it stands in for is the
//! driver: kernels run on the simulated GPU, and a sampled launch's bracket is its kernel's time
//! on it. Admission follows `runtime::admission` (charge the estimate times the factor, sleep the
//! refill's time clamped to its bounds, retry). The same seed gives the same result, and every
//! bound the GPU suite checks is asserted in milliseconds.
//!
//! The GPU: each stream runs its kernels in order; kernels of different streams of one container
//! run side by side; containers (separate buckets) take turns, a kernel waiting for the other
//! container's kernel in flight (the time slicing of two contexts). A kernel's duration may depend
//! on how busy the GPU was lately (clocks that rise when it is less busy). The truth is the union
//! of each container's kernel intervals.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};

use vgpu_region::ComputeDevice;

use super::bucket;
use super::estimates::Estimates;
use super::overlap;
use super::runtime::admission::{MAX_WAIT_NS, MIN_WAIT_NS};
use super::runtime::poller::POLL_BUSY;

/// Host time of a launch call.
const LAUNCH_CALL_NS: u64 = 3_000;

/// What one thread of a job does.
#[derive(Clone)]
pub struct Thread {
    /// Its process (an index into the simulation's processes).
    pub process: usize,
    /// Its stream (threads of a process with the same stream share it).
    pub stream: usize,
    /// The kernels it launches in turn, each its own key: (key, duration in ns).
    pub kernels: Vec<(u64, u64)>,
    /// Launches per iteration, host time between launches and after an iteration.
    pub per_iteration: u32,
    pub gap_ns: u64,
    pub pause_ns: u64,
    /// Synchronises its stream every this many iterations.
    pub sync_every: u32,
}

/// A process: its container (bucket) and limit.
#[derive(Clone, Copy)]
pub struct Process {
    pub container: usize,
    pub limit: u8,
}

/// A job for the simulation.
#[derive(Clone)]
pub struct Job {
    pub processes: Vec<Process>,
    pub threads: Vec<Thread>,
    pub seconds: u64,
    /// Host time of each key's first launch in a process (lazy module loading).
    pub first_launch_ns: u64,
    /// Kernels run this much faster (a share) on a GPU idle the whole last period than on one busy
    /// all the time (boost clocks).
    pub boost: f64,
    /// What the sensor reads of a kernel's time (1: exact); a deliberately broken sensor otherwise.
    pub sensor_scale: f64,
}

/// What a simulated job did.
pub struct Outcome {
    /// Per container, the share (percent) of each whole second the GPU was busy with its kernels.
    pub per_second: Vec<Vec<f64>>,
    /// Per container, the share of the whole run.
    pub mean: Vec<f64>,
    /// Per container, the kernels that completed.
    pub kernels: Vec<u64>,
}

struct ThreadState {
    next: usize,
    launched_in_iteration: u32,
    iterations: u32,
    /// A launch planned but still waiting for budget.
    waiting: Option<Planned>,
}

/// A planned launch: its key and duration, what the estimates planned, what the bucket is charged
/// (the plan times the overlap factor), and whether it is sampled.
#[derive(Clone, Copy)]
struct Planned {
    key: u64,
    duration: u64,
    planned: u64,
    charge: u64,
    sample: bool,
}

/// A sample in flight: when it can be read, its key, what was planned for it, its bracket's
/// reading, its stream and the bracket's ends on the GPU.
struct Sample {
    ready: u64,
    key: u64,
    planned: u64,
    reading: u64,
    stream: usize,
    from: u64,
    to: u64,
}

struct ProcessState {
    estimates: Estimates,
    window: overlap::Window,
    loaded: HashSet<u64>,
    samples: Vec<Sample>,
}

struct Gpu {
    /// Per (container, stream): when its queued work ends.
    stream_end: Vec<Vec<u64>>,
    /// Per container: its kernels' intervals, and per stream.
    intervals: Vec<Vec<(u64, u64, usize)>>,
    /// When the other containers' kernels in flight end, per container.
    container_end: Vec<u64>,
}

fn factor(window: &overlap::Window) -> f64 {
    window.factor()
}

/// The time the other streams of a container had kernels during `from..to`, summed over those
/// streams, over `to - from`: what the overlap windows measure on a GPU.
fn streams_beside(intervals: &[(u64, u64, usize)], stream: usize, from: u64, to: u64) -> f64 {
    let span = to.saturating_sub(from).max(1);
    let mut by_stream: Vec<(usize, (i64, i64))> = intervals
        .iter()
        .rev()
        .take(4096)
        .filter(|&&(start, end, s)| s != stream && end > from && start < to)
        .map(|&(start, end, s)| (s, (start.max(from) as i64, end.min(to) as i64)))
        .collect();
    by_stream.sort_unstable();
    let mut covered = 0u64;
    for group in by_stream.chunk_by(|a, b| a.0 == b.0) {
        let mut spans: Vec<(i64, i64)> = group.iter().map(|&(_, span)| span).collect();
        covered += overlap::union_and_sum(&mut spans).0;
    }
    1.0 + covered as f64 / span as f64
}

/// Runs `job` from every thread's first launch (at 1 s on the virtual clock) for its seconds.
pub fn run(job: &Job) -> Outcome {
    let containers = job.processes.iter().map(|p| p.container).max().map_or(0, |c| c + 1);
    let start = 1_000_000_000u64;
    let end = start + job.seconds * 1_000_000_000;
    // SAFETY: ComputeDevice is atomics only, for which all-zero bytes are valid values.
    let buckets: Vec<Box<ComputeDevice>> = (0..containers)
        .map(|_| Box::new(unsafe { std::mem::zeroed() }))
        .collect();
    let streams = job.threads.iter().map(|t| t.stream).max().map_or(0, |s| s + 1);
    let mut gpu = Gpu {
        stream_end: vec![vec![0; streams]; containers],
        intervals: vec![Vec::new(); containers],
        container_end: vec![0; containers],
    };
    let mut processes: Vec<ProcessState> = job
        .processes
        .iter()
        .map(|_| ProcessState {
            estimates: Estimates::default(),
            window: overlap::Window::default(),
            loaded: HashSet::new(),
            samples: Vec::new(),
        })
        .collect();
    let mut threads: Vec<ThreadState> = job
        .threads
        .iter()
        .map(|_| ThreadState {
            next: 0,
            launched_in_iteration: 0,
            iterations: 0,
            waiting: None,
        })
        .collect();
    // Actors: threads 0..n, then each process's background thread.
    let pollers = job.threads.len();
    let mut queue: BinaryHeap<Reverse<(u64, usize)>> = (0..job.threads.len() + job.processes.len())
        .map(|actor| Reverse((start, actor)))
        .collect();
    let busy_recently = |gpu: &Gpu, container: usize, now: u64| -> f64 {
        let from = now.saturating_sub(100_000_000);
        let busy: u64 = gpu.intervals[container]
            .iter()
            .rev()
            .take_while(|&&(_, e, _)| e > from)
            .map(|&(s, e, _)| e.min(now).saturating_sub(s.max(from)))
            .sum();
        (busy as f64 / 100_000_000.0).min(1.0)
    };
    while let Some(Reverse((now, actor))) = queue.pop() {
        if now >= end {
            continue;
        }
        if actor >= pollers {
            let index = actor - pollers;
            let container = job.processes[index].container;
            let process = &mut processes[index];
            let (ready, later): (Vec<_>, Vec<_>) = process.samples.drain(..).partition(|s| s.ready <= now);
            process.samples = later;
            for sample in ready {
                let correction = process.estimates.measured(sample.key, sample.planned, sample.reading);
                let scaled = correction as f64 * factor(&process.window);
                bucket::add(&buckets[container], -(scaled as i64));
                let beside = streams_beside(&gpu.intervals[container], sample.stream, sample.from, sample.to);
                process
                    .window
                    .add((sample.reading as f64 / beside) as u64, sample.reading);
            }
            queue.push(Reverse((now + POLL_BUSY.as_nanos() as u64, actor)));
            continue;
        }
        let thread = &job.threads[actor];
        let state = &mut threads[actor];
        let process = &mut processes[thread.process];
        let container = job.processes[thread.process].container;
        let limit = job.processes[thread.process].limit;
        let launch = match state.waiting.take() {
            Some(waiting) => waiting,
            None => {
                let (key, duration) = thread.kernels[state.next % thread.kernels.len()];
                let plan = process.estimates.plan(key, now);
                Planned {
                    key,
                    duration,
                    planned: plan.charge,
                    charge: (plan.charge as f64 * factor(&process.window)) as u64,
                    sample: plan.sample,
                }
            }
        };
        if limit < 100
            && let Err(wait) = bucket::try_take(&buckets[container], now, limit, launch.charge)
        {
            state.waiting = Some(launch);
            queue.push(Reverse((now + wait.clamp(MIN_WAIT_NS, MAX_WAIT_NS), actor)));
            continue;
        }
        let Planned {
            key,
            duration,
            planned,
            sample,
            ..
        } = launch;
        let mut host = now + LAUNCH_CALL_NS;
        if process.loaded.insert(key) {
            host += job.first_launch_ns;
        }
        let clocked = 1.0 - job.boost * (1.0 - busy_recently(&gpu, container, host));
        let duration = ((duration as f64) * clocked).max(1.0) as u64;
        let others_end = (0..containers)
            .filter(|&c| c != container)
            .map(|c| gpu.container_end[c])
            .max()
            .unwrap_or(0);
        let queued = gpu.stream_end[container][thread.stream].max(host);
        // Another container's kernel in flight runs first (the contexts take turns).
        let kernel_start = queued.max(if others_end > queued { others_end } else { 0 });
        let kernel_end = kernel_start + duration;
        gpu.stream_end[container][thread.stream] = kernel_end;
        gpu.container_end[container] = gpu.container_end[container].max(kernel_end);
        gpu.intervals[container].push((kernel_start, kernel_end, thread.stream));
        if sample {
            // The bracket reads the kernel's own time: the hold keeps its start event next to the
            // kernel, and the other context's turns are short beside it.
            process.samples.push(Sample {
                ready: kernel_end,
                key,
                planned,
                reading: ((kernel_end - kernel_start) as f64 * job.sensor_scale) as u64,
                stream: thread.stream,
                from: kernel_start,
                to: kernel_end,
            });
        }
        state.next += 1;
        state.launched_in_iteration += 1;
        let mut next = host + thread.gap_ns;
        if state.launched_in_iteration >= thread.per_iteration {
            state.launched_in_iteration = 0;
            state.iterations += 1;
            if state.iterations.is_multiple_of(thread.sync_every) {
                next = next.max(gpu.stream_end[container][thread.stream]);
            }
            next += thread.pause_ns;
        }
        queue.push(Reverse((next, actor)));
    }
    let mut outcome = Outcome {
        per_second: Vec::new(),
        mean: Vec::new(),
        kernels: Vec::new(),
    };
    for intervals in &gpu.intervals {
        // The time the container's kernels occupied the GPU in each second: their union there.
        let second = |n: u64| -> f64 {
            let (from, to) = (start + n * 1_000_000_000, start + (n + 1) * 1_000_000_000);
            let mut spans: Vec<(i64, i64)> = intervals
                .iter()
                .filter(|&&(s, e, _)| e > from && s < to)
                .map(|&(s, e, _)| (s.max(from) as i64, e.min(to) as i64))
                .collect();
            overlap::union_and_sum(&mut spans).0 as f64 / 1e7
        };
        let per_second: Vec<f64> = (0..job.seconds).map(second).collect();
        outcome.mean.push(per_second.iter().sum::<f64>() / job.seconds as f64);
        outcome.per_second.push(per_second);
        outcome
            .kernels
            .push(intervals.iter().filter(|&&(_, e, _)| e <= end).count() as u64);
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_thread(kernels: Vec<(u64, u64)>, per_iteration: u32, gap_ns: u64, pause_ns: u64, sync_every: u32) -> Thread {
        Thread {
            process: 0,
            stream: 0,
            kernels,
            per_iteration,
            gap_ns,
            pause_ns,
            sync_every,
        }
    }

    fn job(limit: u8, threads: Vec<Thread>) -> Job {
        Job {
            processes: vec![Process { container: 0, limit }],
            threads,
            seconds: 6,
            first_launch_ns: 20_000_000,
            boost: 0.0,
            sensor_scale: 1.0,
        }
    }

    /// The GPU suite's bounds: the mean within 2 points of the target, every second from the 2nd
    /// within 5. Returns what failed.
    fn misses(name: &str, per_second: &[f64], mean: f64, target: f64) -> Option<String> {
        let worst = per_second
            .iter()
            .skip(1)
            .map(|share| share - target)
            .fold(
                0.0f64,
                |worst, error| if error.abs() > worst.abs() { error } else { worst },
            );
        ((mean - target).abs() > 2.0 || worst.abs() > 5.0)
            .then(|| format!("{name}: mean {mean:.1} against {target}, worst second {worst:+.1} ({per_second:.1?})"))
    }

    fn gemm() -> Thread {
        one_thread(vec![(1, 4_000_000)], 1, 5_000, 0, 10)
    }

    fn small_ops() -> Thread {
        one_thread((10..18).map(|key| (key, 20_000)).collect(), 8, 4_000, 0, 10)
    }

    fn graph() -> Thread {
        one_thread(vec![(30, 160_000)], 1, 5_000, 0, 10)
    }

    fn training_step() -> Thread {
        // Kernels of very different lengths, one of them varying (the same key, 28 and 600 us by
        // turns is modelled as two keys of one mean), synchronised every step.
        one_thread(
            vec![
                (40, 28_000),
                (41, 68_000),
                (42, 92_000),
                (43, 300_000),
                (44, 12_000),
                (45, 1_500_000),
            ],
            6,
            8_000,
            0,
            1,
        )
    }

    fn four_streams() -> Vec<Thread> {
        (0..4)
            .map(|stream| Thread {
                stream,
                ..one_thread(vec![(50, 200_000)], 8, 3_000, 0, 1)
            })
            .collect()
    }

    fn shapes() -> Vec<(&'static str, Vec<Thread>)> {
        vec![
            ("gemm", vec![gemm()]),
            ("small ops", vec![small_ops()]),
            ("graph", vec![graph()]),
            ("training step", vec![training_step()]),
        ]
    }

    #[test]
    fn every_single_stream_job_holds_its_limit() {
        let mut failures = Vec::new();
        for (name, threads) in shapes() {
            for limit in [10u8, 25, 50, 75, 90] {
                let outcome = run(&job(limit, threads.clone()));
                failures.extend(misses(
                    &format!("{name} at {limit}"),
                    &outcome.per_second[0],
                    outcome.mean[0],
                    f64::from(limit),
                ));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn the_same_job_gives_the_same_result() {
        let first = run(&job(50, vec![training_step()]));
        let second = run(&job(50, vec![training_step()]));
        assert_eq!(first.per_second, second.per_second);
        assert_eq!(first.kernels, second.kernels);
    }

    #[test]
    fn a_job_below_its_limit_is_not_slowed() {
        // 8 small kernels, then 2 ms of host work: about 7% of the GPU.
        let paused = one_thread((10..18).map(|key| (key, 20_000)).collect(), 8, 4_000, 2_000_000, 1);
        let free = run(&job(100, vec![paused.clone()]));
        let held = run(&job(50, vec![paused]));
        assert!(free.mean[0] < 20.0, "{}", free.mean[0]);
        assert!(
            held.kernels[0] as f64 >= 0.98 * free.kernels[0] as f64,
            "{} of {}",
            held.kernels[0],
            free.kernels[0]
        );
    }

    #[test]
    fn four_streams_side_by_side_hold_the_limit_and_half_their_work() {
        let free = run(&job(100, four_streams()));
        let held = run(&job(50, four_streams()));
        let work = held.kernels[0] as f64 / free.kernels[0] as f64;
        assert!(free.mean[0] > 95.0, "{}", free.mean[0]);
        assert!(
            misses("four streams at 50", &held.per_second[0], held.mean[0], 50.0).is_none(),
            "{:.1?}",
            held.per_second[0]
        );
        assert!(
            (work - 0.5).abs() <= 0.05,
            "four streams at 50 did {:.1}% of the unlimited work",
            work * 100.0
        );
    }

    #[test]
    fn two_processes_of_one_container_share_its_limit() {
        let mut shared = job(
            50,
            vec![
                gemm(),
                Thread {
                    process: 1,
                    stream: 1,
                    ..small_ops()
                },
            ],
        );
        shared.processes.push(Process {
            container: 0,
            limit: 50,
        });
        let outcome = run(&shared);
        assert!(
            misses("two processes at 50", &outcome.per_second[0], outcome.mean[0], 50.0).is_none(),
            "{:.1?}",
            outcome.per_second[0]
        );
    }

    #[test]
    fn two_containers_split_the_gpu_30_70() {
        let mut split = job(30, vec![gemm(), Thread { process: 1, ..gemm() }]);
        split.processes.push(Process {
            container: 1,
            limit: 70,
        });
        let outcome = run(&split);
        let share = outcome.mean[0] * 100.0 / (outcome.mean[0] + outcome.mean[1]);
        assert!(
            (share - 30.0).abs() <= 3.0,
            "30/70: {:.1} : {:.1}",
            outcome.mean[0],
            outcome.mean[1]
        );
    }

    #[test]
    fn clocks_that_rise_when_the_gpu_is_less_busy_keep_the_time_share() {
        let mut boosted = job(50, vec![gemm()]);
        boosted.boost = 0.15;
        let outcome = run(&boosted);
        assert!(
            misses("boosted gemm at 50", &outcome.per_second[0], outcome.mean[0], 50.0).is_none(),
            "{:.1?}",
            outcome.per_second[0]
        );
    }

    /// The simulation catches a sensor that reads 80% of a kernel's time: the job then runs over
    /// its limit by a quarter.
    #[test]
    fn a_broken_sensor_is_caught() {
        let mut broken = job(50, vec![graph()]);
        broken.sensor_scale = 0.8;
        let outcome = run(&broken);
        let missed = misses(
            "graph at 50, sensor at 80%",
            &outcome.per_second[0],
            outcome.mean[0],
            50.0,
        );
        assert!(missed.is_some() && outcome.mean[0] > 58.0, "{:.1}", outcome.mean[0]);
    }
}
