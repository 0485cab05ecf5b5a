//! The capture writer: packets are formatted as PCAP or PCAPNG records straight into large
//! buffers on the data path, and a separate writer thread writes whole buffers (one `write` per
//! 4 MiB), rotates files by size or time, and keeps a ring of files. The data path never waits:
//! when every buffer is queued for writing, packets are dropped and counted.
//!
//! Durability: buffers hold whole records, so every file ends on a record boundary; a write that
//! fails half-way (disk full, folder gone) is cut back to the last complete buffer, the error is
//! logged once with what to do, and the capture goes on counting the packets it cannot keep.
//! A PCAPNG file ends with an interface statistics block (packets received and dropped).
//!
//! At an upgrade the writer is held ([`CaptureWriter::hold`]): everything queued is written
//! and the thread waits, giving where the file stands ([`FileState`]); a successor writes on
//! in that file ([`CaptureWriter::resume_at`]), and if there is none the writer goes on.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use stitch_core::packet::now_ns;

/// Bytes per buffer: one `write` each.
pub const BUFFER_BYTES: usize = 4 << 20;

pub use crate::capture_format::Format;
use crate::capture_format::{
    append_record, interface_block, pcap_header, record_at, record_len, section_header,
    statistics_block, Direction, InterfaceCounts, RecordMeta,
};

/// What and where to write.
#[derive(Debug, Clone)]
pub struct FileSpec {
    /// File name; with `rotate_seconds` it is a strftime pattern, as in tcpdump.
    pub path: PathBuf,
    pub format: Format,
    pub snaplen: u32,
    /// Interface name recorded in PCAPNG files.
    pub interface: String,
    /// Start a new file when this many bytes would be exceeded (tcpdump -C, in bytes).
    pub rotate_bytes: Option<u64>,
    /// Start a new file every this many seconds (tcpdump -G).
    pub rotate_seconds: Option<u64>,
    /// Keep at most this many files, reusing names in a ring (tcpdump -W).
    pub files: Option<u32>,
    /// Buffers between the data path and the writer (× 4 MiB).
    pub buffers: usize,
}

/// Counters shared by the data path and the writer thread.
#[derive(Default)]
pub struct WriterStats {
    pub bytes_written: AtomicU64,
    pub files_opened: AtomicU64,
    pub write_errors: AtomicU64,
    /// Records lost because a write failed.
    pub records_lost: AtomicU64,
    failed: AtomicBool,
}

enum Job {
    Data {
        buf: Vec<u8>,
        records: u64,
    },
    /// Write out everything, say where the file stands and wait for `Resume` (or the end).
    Hold(SyncSender<Option<FileState>>),
    Resume,
    /// Close the file; for PCAPNG with interface statistics (received, dropped).
    Close {
        received: u64,
        dropped: u64,
    },
}

/// Where a held capture's current file stands, for a process that writes on in it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FileState {
    pub path: PathBuf,
    /// Bytes in it, all whole records.
    pub written: u64,
    /// Files opened so far (the ring's next name follows).
    pub index: u64,
    /// How long it has been open (time rotation).
    pub age_seconds: f64,
    pub bytes_written_total: u64,
    pub files_opened_total: u64,
}

/// The data-path half: formats records into buffers and hands full ones to the writer thread.
pub struct CaptureWriter {
    spec: FileSpec,
    current: Option<Vec<u8>>,
    current_records: u64,
    current_since: Instant,
    to_writer: Option<SyncSender<Job>>,
    free: Receiver<Vec<u8>>,
    thread: Option<JoinHandle<()>>,
    pub stats: Arc<WriterStats>,
}

/// Bytes of the file header (PCAP) or section + interface blocks (PCAPNG).
fn file_header(spec: &FileSpec) -> Vec<u8> {
    match spec.format {
        Format::Pcap => pcap_header(spec.snaplen),
        Format::Pcapng => {
            let mut h = section_header();
            h.extend(interface_block(&spec.interface, None, spec.snaplen));
            h
        }
    }
}

/// Bytes and count of the longest run of whole records at the start of `buf` that fits in
/// `limit` bytes.
fn records_in(buf: &[u8], format: Format, limit: usize) -> (usize, u64) {
    let (mut at, mut n) = (0usize, 0u64);
    while at < buf.len() {
        let len = record_at(&buf[at..], format);
        if len == 0 || at + len > limit.min(buf.len()) {
            break;
        }
        at += len;
        n += 1;
    }
    (at, n)
}

/// The first record of `buf` on its own.
fn first_record(buf: &[u8], format: Format) -> (usize, u64) {
    (record_at(buf, format).min(buf.len()), 1)
}

impl CaptureWriter {
    /// Opens the first file and starts the writer thread.
    pub fn start(spec: FileSpec) -> Result<CaptureWriter, String> {
        CaptureWriter::start_on(spec, None)
    }

    /// Starts the writer thread on the file a predecessor process held ([`CaptureWriter::hold`]),
    /// writing on after its last record.
    pub fn resume_at(spec: FileSpec, at: FileState) -> Result<CaptureWriter, String> {
        CaptureWriter::start_on(spec, Some(at))
    }

    fn start_on(spec: FileSpec, at: Option<FileState>) -> Result<CaptureWriter, String> {
        let buffers = spec.buffers.max(2);
        let (to_writer, jobs) = mpsc::sync_channel::<Job>(buffers);
        let (give_back, free) = mpsc::sync_channel::<Vec<u8>>(buffers + 1);
        for _ in 0..buffers {
            give_back
                .send(Vec::with_capacity(BUFFER_BYTES))
                .expect("fresh channel");
        }
        let stats = Arc::new(WriterStats::default());
        let mut files = FileRing::new(spec.clone(), stats.clone());
        match at {
            Some(at) => files.reopen(at)?,
            None => files.open_next(now_ns())?,
        }
        let thread = std::thread::Builder::new()
            .name("stitch-capture-writer".into())
            .spawn(move || writer_loop(files, jobs, give_back))
            .map_err(|e| format!("cannot start the capture writer thread: {e}"))?;
        Ok(CaptureWriter {
            spec,
            current: None,
            current_records: 0,
            current_since: Instant::now(),
            to_writer: Some(to_writer),
            free,
            thread: Some(thread),
            stats,
        })
    }

    /// Records one packet; returns false when it had to be dropped (all buffers queued).
    #[inline]
    pub fn record(&mut self, ts_ns: u64, data: &[u8]) -> bool {
        let cap = data.len().min(self.spec.snaplen as usize);
        let need = record_len(self.spec.format, cap, Direction::Unknown);
        if self
            .current
            .as_ref()
            .is_some_and(|b| b.len() + need > b.capacity())
        {
            self.flush();
        }
        if self.current.is_none() {
            match self.free.try_recv() {
                Ok(b) => {
                    self.current = Some(b);
                    self.current_since = Instant::now();
                }
                Err(_) => return false,
            }
        }
        let buf = self.current.as_mut().expect("just set");
        let meta = RecordMeta {
            ts_ns,
            orig_len: data.len(),
            interface: 0,
            direction: Direction::Unknown,
        };
        append_record(buf, self.spec.format, meta, &data[..cap]);
        self.current_records += 1;
        true
    }

    /// Hands the current buffer to the writer, if any; keeps it when the queue is full.
    pub fn flush(&mut self) {
        let Some(buf) = self.current.take() else {
            return;
        };
        if buf.is_empty() {
            self.current = Some(buf);
            return;
        }
        let Some(tx) = &self.to_writer else { return };
        match tx.try_send(Job::Data {
            buf,
            records: self.current_records,
        }) {
            Ok(()) => self.current_records = 0,
            Err(TrySendError::Full(Job::Data { buf, .. }))
            | Err(TrySendError::Disconnected(Job::Data { buf, .. })) => {
                self.current = Some(buf);
            }
            Err(_) => {}
        }
    }

    /// Flushes a partly filled buffer that waited longer than `age` (files grow while capture
    /// goes on; time rotation happens at low rates too).
    pub fn flush_if_older(&mut self, age: Duration) {
        if self.current.as_ref().is_some_and(|b| !b.is_empty())
            && self.current_since.elapsed() >= age
        {
            self.flush();
        }
    }

    /// For an upgrade: writes out everything recorded so far and holds the thread (it writes
    /// nothing more, rotates nothing) until [`CaptureWriter::resume`]; where the file stands,
    /// or `None` when there is no file (a write failed) or the thread did not answer.
    pub fn hold(&mut self) -> Option<FileState> {
        let tx = self.to_writer.as_ref()?;
        if let Some(buf) = self.current.take().filter(|b| !b.is_empty()) {
            tx.send(Job::Data {
                buf,
                records: self.current_records,
            })
            .ok()?;
            self.current_records = 0;
        }
        let (reply, state) = mpsc::sync_channel(1);
        tx.send(Job::Hold(reply)).ok()?;
        state.recv_timeout(Duration::from_secs(5)).ok().flatten()
    }

    /// Lets a held writer go on.
    pub fn resume(&mut self) {
        if let Some(tx) = &self.to_writer {
            let _ = tx.send(Job::Resume);
        }
    }

    /// Writes everything, closes the file (PCAPNG: with interface statistics) and stops the
    /// writer thread. Blocks until the data is written.
    pub fn close(&mut self, received: u64, dropped: u64) {
        let Some(tx) = self.to_writer.take() else {
            return;
        };
        if let Some(buf) = self.current.take().filter(|b| !b.is_empty()) {
            let _ = tx.send(Job::Data {
                buf,
                records: self.current_records,
            });
        }
        let _ = tx.send(Job::Close { received, dropped });
        drop(tx);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for CaptureWriter {
    fn drop(&mut self) {
        self.close(0, 0);
    }
}

/// Bytes of the blocks O_DIRECT writes (a multiple of every disk's sector size).
const BLOCK: usize = 4096;

/// One capture file. Where the filesystem takes O_DIRECT, bytes are staged in a block-aligned
/// buffer and written in whole blocks, past the page cache (whose writeback made buffered
/// captures stall and vary); the last partial block is written through the page cache at
/// close. Elsewhere (tmpfs), plain buffered writes.
struct Output {
    file: File,
    direct: bool,
    stage: Vec<u8>,
    /// Where the aligned part of `stage` starts.
    base: usize,
    staged: usize,
    on_disk: u64,
    /// Chunks of whole records not yet all on disk: where each ends, and its record count.
    ends: std::collections::VecDeque<(u64, u64)>,
    /// The end of the last whole record that is on disk.
    complete: u64,
}

impl Output {
    fn create(path: &Path) -> std::io::Result<Output> {
        // Captured traffic is for root's eyes (0600), and never written through a name another
        // user planted (`files::create_output`).
        let direct = stitch_core::files::create_output(path, 0o600, libc::O_DIRECT);
        let (file, direct) = match direct {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                (stitch_core::files::create_output(path, 0o600, 0)?, false)
            }
            Err(e) => return Err(e),
        };
        let stage = if direct {
            vec![0u8; BUFFER_BYTES + 2 * BLOCK]
        } else {
            Vec::new()
        };
        let base = stage.as_ptr().align_offset(BLOCK).min(BLOCK);
        Ok(Output {
            file,
            direct,
            stage,
            base,
            staged: 0,
            on_disk: 0,
            ends: Default::default(),
            complete: 0,
        })
    }

    /// A file another process wrote `on_disk` bytes of, written on through the page cache.
    fn appending(file: File, on_disk: u64) -> Output {
        Output {
            file,
            direct: false,
            stage: Vec::new(),
            base: 0,
            staged: 0,
            on_disk,
            ends: Default::default(),
            complete: on_disk,
        }
    }

    fn capacity(&self) -> usize {
        BUFFER_BYTES + BLOCK
    }

    /// Writes `data`: `records` whole records.
    fn write(&mut self, mut data: &[u8], records: u64) -> std::io::Result<()> {
        let end = self.on_disk + (self.staged + data.len()) as u64;
        self.ends.push_back((end, records));
        if !self.direct {
            self.file.write_all(data)?;
            self.on_disk += data.len() as u64;
            self.complete = self.on_disk;
            self.ends.clear();
            return Ok(());
        }
        while !data.is_empty() {
            let n = (self.capacity() - self.staged).min(data.len());
            let at = self.base + self.staged;
            self.stage[at..at + n].copy_from_slice(&data[..n]);
            self.staged += n;
            data = &data[n..];
            if self.staged == self.capacity() {
                self.write_blocks()?;
            }
        }
        self.write_blocks()
    }

    /// Writes the staged whole blocks.
    fn write_blocks(&mut self) -> std::io::Result<()> {
        let whole = self.staged / BLOCK * BLOCK;
        if whole > 0 {
            self.file
                .write_all(&self.stage[self.base..self.base + whole])?;
            self.on_disk += whole as u64;
            self.stage
                .copy_within(self.base + whole..self.base + self.staged, self.base);
            self.staged -= whole;
        }
        while self.ends.front().is_some_and(|(e, _)| *e <= self.on_disk) {
            self.complete = self.ends.pop_front().unwrap().0;
        }
        Ok(())
    }

    /// Writes what is staged (the last partial block, through the page cache).
    fn drain(&mut self) -> std::io::Result<()> {
        if self.direct && self.staged > 0 {
            use std::os::fd::AsRawFd;
            let fd = self.file.as_raw_fd();
            // SAFETY: fcntl on a descriptor this writer owns; no pointers.
            unsafe {
                let flags = libc::fcntl(fd, libc::F_GETFL);
                libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_DIRECT);
            }
            self.direct = false;
            let tail = self.stage[self.base..self.base + self.staged].to_vec();
            self.staged = 0;
            self.file.write_all(&tail)?;
            self.on_disk += tail.len() as u64;
        }
        self.complete = self.on_disk;
        self.ends.clear();
        Ok(())
    }

    /// After a failed write: the file ends with its last whole record on disk; returns how
    /// many records that leaves out.
    fn cut_back(&mut self) -> u64 {
        let _ = self.file.set_len(self.complete);
        let lost = self.ends.drain(..).map(|(_, r)| r).sum();
        self.staged = 0;
        lost
    }
}

/// The files of a capture: naming, rotation, the ring.
struct FileRing {
    spec: FileSpec,
    /// The bytes every file starts with (PCAP header, or PCAPNG section and interface blocks).
    header: Vec<u8>,
    stats: Arc<WriterStats>,
    file: Option<Output>,
    path: PathBuf,
    written: u64,
    opened_at: Instant,
    index: u64,
}

impl FileRing {
    fn new(spec: FileSpec, stats: Arc<WriterStats>) -> FileRing {
        FileRing {
            header: file_header(&spec),
            spec,
            stats,
            file: None,
            path: PathBuf::new(),
            written: 0,
            opened_at: Instant::now(),
            index: 0,
        }
    }

    /// The name of the file to open next, as tcpdump names them.
    fn next_name(&self, now_ns: u64) -> PathBuf {
        let base = self.spec.path.to_string_lossy().into_owned();
        let base = if self.spec.rotate_seconds.is_some() {
            strftime(&base, now_ns)
        } else {
            base
        };
        let n = match self.spec.files {
            Some(w) => self.index % w as u64,
            None => self.index,
        };
        if self.spec.rotate_bytes.is_some() && (self.index > 0 || self.spec.files.is_some()) {
            let width = self
                .spec
                .files
                .map(|w| (w.max(2) - 1).to_string().len())
                .unwrap_or(0);
            PathBuf::from(format!("{base}{n:0width$}"))
        } else if self.spec.files.is_some()
            && self.spec.rotate_seconds.is_some()
            && !base.contains('%')
        {
            let width = (self.spec.files.unwrap().max(2) - 1).to_string().len();
            PathBuf::from(format!("{base}{n:0width$}"))
        } else {
            PathBuf::from(base)
        }
    }

    fn open_next(&mut self, now_ns: u64) -> Result<(), String> {
        let path = self.next_name(now_ns);
        let mut f = Output::create(&path).map_err(|e| explain_io(&path, &e))?;
        f.write(&self.header, 0).map_err(|e| {
            f.cut_back();
            explain_io(&path, &e)
        })?;
        self.written = self.header.len() as u64;
        self.stats.bytes_written.fetch_add(self.written, Relaxed);
        self.stats.files_opened.fetch_add(1, Relaxed);
        self.file = Some(f);
        self.path = path;
        self.opened_at = Instant::now();
        self.index += 1;
        Ok(())
    }

    /// Writes on in the file a predecessor held, after its last whole record.
    fn reopen(&mut self, at: FileState) -> Result<(), String> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&at.path)
            .map_err(|e| explain_io(&at.path, &e))?;
        // Anything past the last whole record (there should be nothing) goes.
        let placed = file.set_len(at.written).and_then(|()| {
            use std::io::{Seek, SeekFrom};
            (&file).seek(SeekFrom::Start(at.written)).map(|_| ())
        });
        placed.map_err(|e| explain_io(&at.path, &e))?;
        self.file = Some(Output::appending(file, at.written));
        self.written = at.written;
        self.index = at.index;
        self.opened_at = Instant::now()
            .checked_sub(Duration::from_secs_f64(at.age_seconds.max(0.0)))
            .unwrap_or_else(Instant::now);
        self.path = at.path;
        self.stats
            .bytes_written
            .store(at.bytes_written_total, Relaxed);
        self.stats
            .files_opened
            .store(at.files_opened_total, Relaxed);
        Ok(())
    }

    /// Writes out what is staged; where the file stands (`None` without a file).
    fn hold(&mut self) -> Option<FileState> {
        let f = self.file.as_mut()?;
        if let Err(e) = f.drain() {
            let lost = f.cut_back();
            self.stats.records_lost.fetch_add(lost, Relaxed);
            let msg = explain_io(&self.path, &e);
            self.fail(&msg);
            self.file = None;
            return None;
        }
        Some(FileState {
            path: self.path.clone(),
            written: self.written,
            index: self.index,
            age_seconds: self.opened_at.elapsed().as_secs_f64(),
            bytes_written_total: self.stats.bytes_written.load(Relaxed),
            files_opened_total: self.stats.files_opened.load(Relaxed),
        })
    }

    fn rotate(&mut self) {
        self.finish(None);
        if let Err(e) = self.open_next(now_ns()) {
            self.fail(&e);
        }
    }

    /// Time rotation (-G); checked before every write and when the writer is idle.
    fn rotate_if_due(&mut self) {
        if self
            .spec
            .rotate_seconds
            .is_some_and(|g| self.opened_at.elapsed() >= Duration::from_secs(g))
        {
            self.rotate();
        }
    }

    /// Writes a buffer of whole records, split at record boundaries where the size limit (-C)
    /// says a new file begins. On failure the file is cut back to where it was.
    fn write(&mut self, buf: &[u8]) {
        self.rotate_if_due();
        let mut rest = buf;
        while !rest.is_empty() {
            let (len, records) = match self.spec.rotate_bytes {
                None => records_in(rest, self.spec.format, usize::MAX),
                Some(limit) => {
                    let room = limit.saturating_sub(self.written) as usize;
                    match records_in(rest, self.spec.format, room) {
                        (0, _) if self.written > self.header.len() as u64 => {
                            self.rotate();
                            continue;
                        }
                        // A record larger than the limit goes alone into a file of its own.
                        (0, _) => first_record(rest, self.spec.format),
                        x => x,
                    }
                }
            };
            let (chunk, tail) = rest.split_at(len);
            rest = tail;
            let Some(f) = self.file.as_mut() else {
                self.stats.records_lost.fetch_add(
                    records + records_in(rest, self.spec.format, usize::MAX).1,
                    Relaxed,
                );
                return;
            };
            match f.write(chunk, records) {
                Ok(()) => {
                    self.written += chunk.len() as u64;
                    self.stats
                        .bytes_written
                        .fetch_add(chunk.len() as u64, Relaxed);
                }
                Err(e) => {
                    // The records of this chunk and of those still staged are lost.
                    let staged = f.cut_back();
                    let left = records_in(rest, self.spec.format, usize::MAX).1;
                    self.stats.records_lost.fetch_add(staged + left, Relaxed);
                    let msg = explain_io(&self.path, &e);
                    self.fail(&msg);
                    self.file = None;
                    return;
                }
            }
        }
    }

    fn fail(&mut self, msg: &str) {
        self.stats.write_errors.fetch_add(1, Relaxed);
        if !self.stats.failed.swap(true, Relaxed) {
            log::error!("capture: {msg}; packets are counted but not written from here on");
        }
    }

    /// Closes the current file, with an interface statistics block for PCAPNG when given.
    fn finish(&mut self, stats: Option<(u64, u64)>) {
        let Some(mut f) = self.file.take() else {
            return;
        };
        if let Err(e) = f.drain() {
            let lost = f.cut_back();
            self.stats.records_lost.fetch_add(lost, Relaxed);
            let msg = explain_io(&self.path, &e);
            self.fail(&msg);
            return;
        }
        if let (Format::Pcapng, Some((recv, drop))) = (self.spec.format, stats) {
            let counts = InterfaceCounts {
                received: recv,
                dropped: drop,
                accepted: None,
            };
            let isb = statistics_block(0, counts);
            if f.write(&isb, 0).is_ok() {
                self.written += isb.len() as u64;
            } else {
                f.cut_back();
            }
        }
        if let Err(e) = f.file.sync_data() {
            let msg = explain_io(&self.path, &e);
            self.fail(&msg);
        }
    }
}

fn explain_io(path: &Path, e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ENOSPC) => format!(
            "{}: the disk is full (free space, or rotate with -C/-W)",
            path.display()
        ),
        Some(libc::ENOENT) => format!("{}: the folder does not exist (any more)", path.display()),
        Some(libc::EACCES) | Some(libc::EPERM) => format!("{}: permission denied", path.display()),
        _ => format!("{}: {e}", path.display()),
    }
}

/// Writes a buffer of records and hands it back, empty, to the data path.
fn write_and_give_back(files: &mut FileRing, mut buf: Vec<u8>, give_back: &SyncSender<Vec<u8>>) {
    files.write(&buf);
    buf.clear();
    let _ = give_back.try_send(buf);
}

fn writer_loop(mut files: FileRing, jobs: Receiver<Job>, give_back: SyncSender<Vec<u8>>) {
    'jobs: loop {
        let job = match jobs.recv_timeout(Duration::from_millis(200)) {
            Ok(j) => j,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                files.rotate_if_due();
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        match job {
            Job::Data { buf, .. } => write_and_give_back(&mut files, buf, &give_back),
            Job::Close { received, dropped } => {
                files.finish(Some((received, dropped)));
                break;
            }
            Job::Hold(reply) => {
                let _ = reply.send(files.hold());
                // Held: nothing is written or rotated until told to go on; a process that
                // handed over exits meanwhile.
                loop {
                    match jobs.recv() {
                        Ok(Job::Resume) => break,
                        Ok(Job::Close { received, dropped }) => {
                            files.finish(Some((received, dropped)));
                            break 'jobs;
                        }
                        Err(_) => break 'jobs,
                        Ok(Job::Data { buf, .. }) => {
                            write_and_give_back(&mut files, buf, &give_back)
                        }
                        Ok(Job::Hold(reply)) => {
                            let _ = reply.send(files.hold());
                        }
                    }
                }
            }
            Job::Resume => {}
        }
    }
    files.finish(None);
    // Drain what might still be queued so that nothing is left unaccounted.
    while let Ok(job) = jobs.try_recv() {
        if let Job::Data { records, .. } = job {
            files.stats.records_lost.fetch_add(records, Relaxed);
        }
    }
}

/// Expands the strftime fields tcpdump users put in -G file names (local time = UTC here).
pub fn strftime(pattern: &str, now_ns: u64) -> String {
    let secs = (now_ns / 1_000_000_000) as libc::time_t;
    // SAFETY: tm is a C struct of integers and a pointer; all zeroes is a valid value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: `secs` and `tm` are live; localtime_r writes only `tm`.
    unsafe { libc::localtime_r(&secs, &mut tm) };
    let Ok(fmt) = std::ffi::CString::new(pattern) else {
        return pattern.to_string();
    };
    let mut out = vec![0u8; pattern.len() * 4 + 64];
    // SAFETY: `out` has out.len() writable bytes, `fmt` is NUL-terminated and `tm` filled above;
    // strftime writes at most out.len() bytes.
    let n = unsafe {
        libc::strftime(
            out.as_mut_ptr() as *mut libc::c_char,
            out.len(),
            fmt.as_ptr(),
            &tm,
        )
    };
    if n == 0 {
        return pattern.to_string();
    }
    out.truncate(n);
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dir: &Path, name: &str, format: Format) -> FileSpec {
        FileSpec {
            path: dir.join(name),
            format,
            snaplen: 262144,
            interface: "test".into(),
            rotate_bytes: None,
            rotate_seconds: None,
            files: None,
            buffers: 4,
        }
    }

    fn read_all(path: &Path) -> Vec<(u64, Vec<u8>)> {
        let mut f = crate::pcap_source::PcapFile::open(path).unwrap();
        let mut out = Vec::new();
        while let Some(r) = f.next_packet() {
            let (ts, d) = r.unwrap();
            out.push((ts, d.to_vec()));
        }
        out
    }

    #[test]
    fn pcap_and_pcapng_files_read_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        for (name, format) in [("a.pcap", Format::Pcap), ("a.pcapng", Format::Pcapng)] {
            let mut w = CaptureWriter::start(spec(dir.path(), name, format)).unwrap();
            let frames: Vec<Vec<u8>> = (0..5000).map(|i| vec![i as u8; 60 + i % 1455]).collect();
            for (i, f) in frames.iter().enumerate() {
                assert!(w.record(1_700_000_000_123_456_789 + i as u64, f));
            }
            w.close(5000, 3);
            let back = read_all(&dir.path().join(name));
            assert_eq!(back.len(), 5000);
            for (i, (ts, d)) in back.iter().enumerate() {
                assert_eq!(*ts, 1_700_000_000_123_456_789 + i as u64);
                assert_eq!(d, &frames[i]);
            }
        }
    }

    #[test]
    fn a_held_file_is_written_on_by_a_successor_or_by_the_writer_that_held_it() {
        let dir = tempfile::tempdir().unwrap();
        for (name, format) in [("h.pcap", Format::Pcap), ("h.pcapng", Format::Pcapng)] {
            let frames: Vec<Vec<u8>> = (0..3000).map(|i| vec![i as u8; 60 + i % 1000]).collect();
            let mut w = CaptureWriter::start(spec(dir.path(), name, format)).unwrap();
            for f in &frames[..1000] {
                assert!(w.record(1, f));
            }
            // Held and let go again (a take-over that failed): it goes on.
            assert!(w.hold().is_some());
            w.resume();
            for f in &frames[1000..2000] {
                assert!(w.record(2, f));
            }
            // Held for a successor (in another process: a writer of its own on the same file).
            let at = w.hold().expect("a file");
            // The process that handed over exits without closing anything.
            std::mem::forget(w);
            assert_eq!(at.written, std::fs::metadata(&at.path).unwrap().len());
            let mut next = CaptureWriter::resume_at(spec(dir.path(), name, format), at).unwrap();
            for f in &frames[2000..] {
                assert!(next.record(3, f));
            }
            next.close(3000, 0);
            assert_eq!(next.stats.files_opened.load(Relaxed), 1);
            let back = read_all(&dir.path().join(name));
            assert_eq!(back.len(), 3000, "{name}");
            assert!(back.iter().zip(&frames).all(|((_, d), f)| d == f), "{name}");
        }
    }

    #[test]
    fn size_rotation_makes_a_ring_of_complete_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spec(dir.path(), "r.pcap", Format::Pcap);
        s.rotate_bytes = Some(5 << 20);
        s.files = Some(3);
        let mut w = CaptureWriter::start(s).unwrap();
        let frame = vec![7u8; 1000];
        let mut n = 0;
        while w.stats.files_opened.load(Relaxed) < 5 {
            if w.record(n, &frame) {
                n += 1;
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        w.close(0, 0);
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, vec!["r.pcap0", "r.pcap1", "r.pcap2"]);
        for name in names {
            let p = dir.path().join(name);
            assert!(std::fs::metadata(&p).unwrap().len() <= 5 << 20);
            assert!(
                read_all(&p).iter().all(|(_, d)| d == &frame),
                "every record complete"
            );
        }
    }

    #[test]
    fn strftime_names_like_tcpdump() {
        // 2023-11-14 22:13:20 UTC
        let s = strftime("cap-%Y%m%d-%H%M%S.pcap", 1_700_000_000_000_000_000);
        assert!(
            s.starts_with("cap-20231114-") && s.ends_with(".pcap"),
            "{s}"
        );
    }
}
