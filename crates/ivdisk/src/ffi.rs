//! The C calls the command line makes itself: while a passphrase prompt has the terminal's
//! echo off, a signal that ends the process (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT) first puts
//! the terminal's settings back. The prompt's own restore runs on return only, and the
//! default action of those signals ended the process at the prompt with echo still off: the
//! user's shell then showed nothing they typed.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicI32, AtomicPtr, Ordering};

/// The signals whose default action ends the process and that a user sends at a prompt.
const ENDING_SIGNALS: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// The terminal's descriptor and its settings from before the prompt, for the handler (which
/// may read only what it can load atomically). The settings are leaked, never freed: a handler
/// running on another thread while the guard is dropped still reads valid memory.
static TERMINAL: AtomicI32 = AtomicI32::new(-1);
static SETTINGS: AtomicPtr<libc::termios> = AtomicPtr::new(std::ptr::null_mut());

/// While it lives, those of the four signals whose action is the default one restore the
/// terminal's settings, then end the process as that action does (the same exit status a
/// shell shows). Dropped: the actions that were there before are back.
pub struct TerminalRestore {
    /// Open while armed: the handler writes to its descriptor.
    _terminal: File,
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

impl TerminalRestore {
    /// `None` without a controlling terminal or its settings (nothing to restore then).
    pub fn arm() -> Option<TerminalRestore> {
        let terminal = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/tty")
            .ok()?;
        // SAFETY: `termios` is plain data; all zeros is a valid value to be overwritten.
        let mut settings: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: a descriptor this function holds open and a valid out-pointer.
        if unsafe { libc::tcgetattr(terminal.as_raw_fd(), &mut settings) } != 0 {
            return None;
        }
        SETTINGS.store(Box::leak(Box::new(settings)), Ordering::Release);
        TERMINAL.store(terminal.as_raw_fd(), Ordering::Release);
        let mut previous = Vec::with_capacity(ENDING_SIGNALS.len());
        for signal in ENDING_SIGNALS {
            // SAFETY: `sigaction` is plain data; zeros are no flags and an empty mask.
            let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
            action.sa_sigaction = restore_terminal_and_end as extern "C" fn(libc::c_int) as usize;
            // SAFETY: as above.
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: valid pointers to our own `sigaction` values; `restore_terminal_and_end`
            // makes only async-signal-safe calls.
            if unsafe { libc::sigaction(signal, &action, &mut old) } != 0 {
                continue;
            }
            if old.sa_sigaction != libc::SIG_DFL {
                // Only the default action ends the process at the prompt. An ignored signal
                // stays ignored (a background job's SIGINT under `sh`), and a command's own
                // handler (a copy's stop on signals) keeps it: that command stops, and the
                // prompt's own restore runs first.
                // SAFETY: as above; `old` is what the kernel just gave back.
                unsafe { libc::sigaction(signal, &old, std::ptr::null_mut()) };
                continue;
            }
            previous.push((signal, old));
        }
        Some(TerminalRestore {
            _terminal: terminal,
            previous,
        })
    }
}

impl Drop for TerminalRestore {
    fn drop(&mut self) {
        for (signal, old) in &self.previous {
            // SAFETY: puts back the action `arm` replaced, as the kernel gave it.
            unsafe { libc::sigaction(*signal, old, std::ptr::null_mut()) };
        }
        // The descriptor closes with `_terminal`, right after this: no handler uses it then.
        TERMINAL.store(-1, Ordering::Release);
    }
}

extern "C" fn restore_terminal_and_end(signal: libc::c_int) {
    let terminal = TERMINAL.load(Ordering::Acquire);
    let settings = SETTINGS.load(Ordering::Acquire);
    if terminal >= 0 && !settings.is_null() {
        // SAFETY: tcsetattr(3) and write(2) are async-signal-safe; `settings` points to a
        // leaked, never freed `termios`. The newline ends the prompt's line, as an echoed
        // ^C would have.
        unsafe {
            libc::tcsetattr(terminal, libc::TCSANOW, settings);
            libc::write(terminal, b"\n".as_ptr().cast(), 1);
        }
    }
    // SAFETY: signal(2) and raise(3) are async-signal-safe. The signal is blocked while its
    // handler runs; once this returns, the default action ends the process.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}
