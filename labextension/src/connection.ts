/**
 * One notebook's link to its kernel's meshes: opens the comm, follows kernel restarts and
 * changes, and says what it knows through signals.
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel, KernelMessage as KM } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';
import { ISignal, Signal } from '@lumino/signaling';

import { Action, IMesh, IMeshesMessage, IRanksMessage, IResultMessage, TARGET } from './protocol';

/** Where the link stands. */
export type LinkState =
  | 'no-kernel' // the notebook has no running kernel
  | 'connecting' // the comm is being opened (the kernel may be busy)
  | 'not-loaded' // the kernel answered: monarch_kernel is not loaded there
  | 'ready'; // meshes are known and kept up to date

const WAITING_STATUSES = new Set<Kernel.Status>(['starting', 'restarting', 'autorestarting', 'unknown']);

export class MeshLink implements IDisposable {
  constructor(readonly sessionContext: ISessionContext) {
    sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    sessionContext.statusChanged.connect(this._onStatusChanged, this);
    this._attach(sessionContext.session?.kernel ?? null);
  }

  /** Emitted when the state or the meshes change. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Emitted with each action's outcome. */
  get results(): ISignal<this, IResultMessage> {
    return this._results;
  }

  get state(): LinkState {
    return this._state;
  }

  get meshes(): IMesh[] {
    return this._meshes;
  }

  get colours(): Record<string, string> {
    return this._colours;
  }

  /** The kernel's symbol per rank state. */
  get glyphs(): Record<string, string> {
    return this._glyphs;
  }

  get kernel(): Kernel.IKernelConnection | null {
    return this._kernel;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  /** Open the comm again (after `%load_ext monarch_kernel`, say). */
  probe(): void {
    const kernel = this._kernel;
    if (this._disposed || !kernel || this._comm) {
      return;
    }
    const comm = kernel.createComm(TARGET);
    this._comm = comm;
    comm.onMsg = (msg: KM.ICommMsgMsg) => {
      const data = msg.content.data as unknown as IMeshesMessage | IRanksMessage | IResultMessage;
      if (data.type === 'meshes') {
        this._meshes = data.meshes;
        this._colours = data.colours ?? this._colours;
        this._glyphs = data.glyphs ?? this._glyphs;
        this._setState('ready', true);
      } else if (data.type === 'ranks') {
        // only what changed travels (a 128-rank mesh sends one rank when one rank changes)
        this._meshes = this._meshes.map(mesh => {
          const changed = data.changes[mesh.name];
          if (!changed) {
            return mesh;
          }
          const byRank = new Map(changed.map(r => [r.rank, r]));
          return { ...mesh, ranks: mesh.ranks.map(r => byRank.get(r.rank) ?? r) };
        });
        this._setState('ready', true);
      } else if (data.type === 'result') {
        this._results.emit(data);
      }
    };
    comm.onClose = () => {
      if (this._comm === comm) {
        this._comm = null;
        this._meshes = [];
        // closed by the kernel: unheard, it has no such comm target (no monarch_kernel
        // loaded); heard, the extension was unloaded
        this._setState('not-loaded', true);
      }
    };
    this._setState('connecting');
    try {
      comm.open({});
    } catch (err) {
      this._comm = null;
      this._setState('no-kernel');
    }
  }

  /** Ask the kernel for the meshes now. */
  refresh(): void {
    if (this._comm) {
      this._send({ type: 'refresh' });
    } else {
      this.probe();
    }
  }

  /** Ask the kernel to act on a mesh; false if there is no link to ask through. */
  act(action: Action, mesh: string, extra: Record<string, number> = {}): boolean {
    return this._send({ type: 'action', action, mesh, ...extra });
  }

  /** The kernel's `monarch_kernel` just loaded: link up (called on its announcement). */
  announced(): void {
    if (this._state !== 'ready') {
      this.probe();
    }
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this._closeComm();
    Signal.clearData(this);
  }

  private _send(data: Record<string, unknown>): boolean {
    const comm = this._comm;
    if (!comm || comm.isDisposed) {
      return false;
    }
    comm.send(data as any);
    return true;
  }

  private _closeComm(): void {
    const comm = this._comm;
    this._comm = null;
    if (comm && !comm.isDisposed) {
      try {
        comm.close();
      } catch (err) {
        // the kernel went away first
      }
    }
  }

  private _attach(kernel: Kernel.IKernelConnection | null): void {
    this._closeComm();
    this._kernel = kernel;
    this._meshes = [];
    if (!kernel) {
      this._setState('no-kernel', true);
      return;
    }
    if (WAITING_STATUSES.has(kernel.status)) {
      this._setState('connecting', true); // _onStatusChanged probes once it is up
    } else {
      this.probe();
    }
  }

  private _onKernelChanged(_: ISessionContext, change: { newValue: Kernel.IKernelConnection | null }): void {
    this._attach(change.newValue);
  }

  private _onStatusChanged(_: ISessionContext, status: Kernel.Status): void {
    if (WAITING_STATUSES.has(status) || status === 'dead') {
      // a restart or a death: the kernel's meshes are gone with its old process
      this._comm = null;
      this._meshes = [];
      this._setState(status === 'dead' ? 'no-kernel' : 'connecting', true);
    } else if ((status === 'idle' || status === 'busy') && this._state === 'connecting' && !this._comm) {
      this.probe();
    }
  }

  private _setState(state: LinkState, force = false): void {
    if (force || state !== this._state) {
      this._state = state;
      this._changed.emit();
    }
  }

  private _kernel: Kernel.IKernelConnection | null = null;
  private _comm: Kernel.IComm | null = null;
  private _state: LinkState = 'no-kernel';
  private _meshes: IMesh[] = [];
  private _colours: Record<string, string> = {};
  private _glyphs: Record<string, string> = {};
  private _disposed = false;
  private _changed = new Signal<this, void>(this);
  private _results = new Signal<this, IResultMessage>(this);
}
