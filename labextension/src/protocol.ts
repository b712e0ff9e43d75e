/**
 * The messages of the `monarch_kernel.meshes` comm (see magics/sidebar.py, the kernel's side).
 */

/** The comm target the kernel extension registers. */
export const TARGET = 'monarch_kernel.meshes';

/** A rank's state (monarch_kernel.core.status.RankStatus). */
export type RankState = 'starting' | 'idle' | 'busy' | 'unresponsive' | 'dead';

/** One rank of a mesh, as the kernel describes it. */
export interface IRank {
  rank: number;
  coords: Record<string, number>;
  host: string;
  /** Its index on its host (its GPU). */
  local_rank: number;
  pid: number | null;
  state: RankState;
  detail: string;
  cpu: number | null;
  rss: number | null;
  /** The host's memory in all (bytes), to scale rss against. */
  mem_total: number | null;
  /** GPU memory used and in all, and utilization (percent); null on hosts without a GPU. */
  gpu_used: number | null;
  gpu_total: number | null;
  gpu_util: number | null;
}

/** One mesh the kernel holds. */
export interface IMesh {
  name: string;
  kind: 'local' | 'ssh' | 'slurm';
  shape: Record<string, number>;
  /** The scheduler's job the mesh runs in: id, state, time left (Slurm meshes; else null). */
  allocation: string | null;
  hosts: string[];
  dist: string;
  state: 'up' | 'down';
  default: boolean;
  /** The rank JupyterLab's debugger stops in (null: another mesh's rank, or no debugger in the kernel). */
  debugged?: number | null;
  ranks: IRank[];
}

/** kernel -> panel: every mesh, sent on open, on refresh and whenever something changes. */
export interface IMeshesMessage {
  type: 'meshes';
  version: number;
  meshes: IMesh[];
  colours?: Record<string, string>;
  /** A symbol per rank state, shown before its word (so no state is told by colour alone). */
  glyphs?: Record<string, string>;
}

/** kernel -> panel: only these ranks changed (the meshes are otherwise as last sent). */
export interface IRanksMessage {
  type: 'ranks';
  version: number;
  changes: Record<string, IRank[]>;
}

/** kernel -> panel: the outcome of an action. */
export interface IResultMessage {
  type: 'result';
  action?: string;
  mesh?: string;
  rank?: number;
  ok: boolean;
  message: string;
  logs?: [string, string][];
  why?: string; // the verdict and the grouped stacks (action "why")
}

/** kernel -> panel, unasked: the extension was just loaded in this kernel. */
export interface ILoadedMessage {
  type: 'loaded';
}

export type KernelMessage = IMeshesMessage | IRanksMessage | IResultMessage | ILoadedMessage;

/** The actions the panel can ask for. */
export type Action = 'interrupt' | 'restart' | 'down' | 'logs' | 'why' | 'debug';
