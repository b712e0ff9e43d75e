/**
 * The Meshes sidebar: for the notebook in focus, every mesh its kernel holds, live, with
 * actions (interrupt, restart, down, why the ranks are where they are, a rank's logs, the rank
 * JupyterLab's debugger stops in, insert a `%%mesh` cell).
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import {
  addIcon,
  bugIcon,
  caretDownIcon,
  caretRightIcon,
  closeIcon,
  LabIcon,
  refreshIcon,
  searchIcon,
  stopIcon
} from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { LinkState, MeshLink } from './connection';
import { IContainer, IPart, patchChildren } from './patch';
import { Action, IMesh, IRank, IResultMessage } from './protocol';

const LOG_LINES = 40;
/** Past this many hosts, each host starts folded into its summary line (as in the mesh widget). */
const FOLD_HOSTS = 8;

const STATE_TEXT: Record<Exclude<LinkState, 'ready'>, string> = {
  'no-kernel': 'This notebook has no running kernel.',
  connecting: 'Connecting to the kernel\u2026',
  'not-loaded': ''
};

function esc(text: unknown): string {
  return String(text ?? '')
    .replace(/&/g, '&amp;')
    .replace(/</g, '&lt;')
    .replace(/>/g, '&gt;')
    .replace(/"/g, '&quot;');
}

function shapeText(shape: Record<string, number>): string {
  return Object.entries(shape)
    .map(([dim, size]) => `${dim} ${size}`)
    .join(' \u00d7 ');
}

function bytesText(n: number | null): string {
  if (n === null || n === undefined) {
    return '';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function stateCounts(ranks: IRank[]): string {
  const counts = new Map<string, number>();
  for (const r of ranks) {
    counts.set(r.state, (counts.get(r.state) ?? 0) + 1);
  }
  return [...counts.entries()]
    .sort((a, b) => b[1] - a[1])
    .map(([state, n]) => `${n} ${state}`)
    .join(' \u00b7 ');
}

/** `3 busy · 1 idle · rss 1.2 GiB`: a host's (or the mesh's) ranks at a glance, as the widget says it. */
function summary(ranks: IRank[]): string {
  const rss = ranks.reduce((total, r) => total + (r.rss ?? 0), 0);
  return stateCounts(ranks) + (rss ? ` \u00b7 rss ${bytesText(rss)}` : '');
}

/** A JupyterLab toolbar-style button: the theme's icon and a short word. */
function iconButton(icon: LabIcon, action: string, label: string, title: string, data: Record<string, string>,
                    enabled = true): string {
  const attributes = Object.entries(data)
    .map(([key, value]) => ` data-${key}="${esc(value)}"`)
    .join('');
  return (
    `<button class="mk-button jp-Button jp-mod-minimal jp-mod-small" data-action="${action}"${attributes} ` +
    `title="${esc(title)}"${enabled ? '' : ' disabled'}>${icon.svgstr}<span>${esc(label)}</span></button>`
  );
}

/** A small labelled bar (cpu, gpu): the same language as the mesh widget's tiles. */
function bar(name: string, percent: number | null, text: string): string {
  const track =
    percent === null
      ? ' '
      : `<span class="mk-bar" role="img" aria-label="${esc(name)} ${esc(text)}">` +
        `<span style="width:${Math.max(2, Math.min(100, percent)).toFixed(0)}%"></span></span>`;
  return `<span class="mk-load">${esc(name)}${track}${esc(text)}</span>`;
}

/** Ranks by host, in the mesh's host order. */
function byHost(mesh: IMesh): [string, IRank[]][] {
  const groups = new Map<string, IRank[]>();
  for (const host of mesh.hosts) {
    groups.set(host, []);
  }
  for (const r of mesh.ranks) {
    const list = groups.get(r.host) ?? [];
    list.push(r);
    groups.set(r.host, list);
  }
  return [...groups.entries()].filter(([, ranks]) => ranks.length);
}

interface IShownLogs {
  mesh: string;
  rank: number;
  lines: [string, string][];
}

export class MeshesPanel extends Widget {
  constructor(private readonly _focus: (notebook: NotebookPanel) => void) {
    super();
    this.id = 'monarch-kernel-meshes';
    this.addClass('mk-panel');
    this.node.innerHTML =
      '<div class="mk-header"><span class="mk-title">Meshes</span>' +
      '<span class="mk-context"></span>' +
      '<button class="mk-button" data-action="refresh" title="Ask the kernel again">Refresh</button></div>' +
      '<div class="mk-body"></div><div class="mk-status" role="status"></div>';
    this.node.addEventListener('click', event => this._onClick(event));
    this._render();
  }

  /** The link the panel shows (null when no notebook is in focus). */
  get link(): MeshLink | null {
    return this._link;
  }

  /** Show the meshes of this notebook's kernel (null: no notebook in focus). */
  follow(notebook: NotebookPanel | null): void {
    if (notebook === this._notebook && this._link) {
      return;
    }
    this._link?.dispose();
    this._link = null;
    this._notebook = notebook;
    this._logs = null;
    this._setStatus('');
    if (notebook && !notebook.isDisposed) {
      const link = new MeshLink(notebook.sessionContext);
      link.changed.connect(() => this._render(), this);
      link.results.connect((_, result) => this._onResult(result), this);
      this._link = link;
      notebook.disposed.connect(() => {
        if (this._notebook === notebook) {
          this.follow(null);
        }
      });
    }
    this._render();
  }

  /** Called when a kernel announces that monarch_kernel loaded in it. */
  announced(notebook: NotebookPanel): void {
    if (notebook === this._notebook) {
      this._link?.announced();
    }
  }

  dispose(): void {
    this._link?.dispose();
    super.dispose();
  }

  private get _body(): HTMLElement {
    return this.node.querySelector('.mk-body') as HTMLElement;
  }

  private _setStatus(message: string, ok = true): void {
    const status = this.node.querySelector('.mk-status') as HTMLElement;
    status.textContent = message;
    status.classList.toggle('mk-error', !ok);
  }

  private _render(): void {
    const context = this.node.querySelector('.mk-context') as HTMLElement;
    context.textContent = this._notebook ? this._notebook.title.label : '';
    const link = this._link;
    const body = this._body;
    body.dataset.state = link ? link.state : 'no-notebook';
    if (!link) {
      body.innerHTML = '<p class="mk-note">Open a notebook to see the meshes of its kernel.</p>';
      return;
    }
    if (link.state === 'not-loaded') {
      body.innerHTML =
        '<p class="mk-note">monarch_kernel is not loaded in this notebook\'s kernel. Run ' +
        '<code>%load_ext monarch_kernel</code> in a cell (or pick the kernel ' +
        '<b>Python 3 (monarch)</b>), then start a mesh with <code>%mesh up local --gpus 2</code>.</p>' +
        '<button class="mk-button" data-action="refresh">Check again</button>';
      return;
    }
    if (link.state !== 'ready') {
      body.innerHTML = `<p class="mk-note">${esc(STATE_TEXT[link.state])}</p>`;
      return;
    }
    if (!link.meshes.length) {
      body.innerHTML =
        '<p class="mk-note">No mesh in this kernel yet. Start one with ' +
        '<code>%mesh up local --gpus 2</code>.</p>';
      return;
    }
    patchChildren(body, link.meshes.map(mesh => this._meshParts(mesh, link.colours, link.glyphs)));
  }

  private _meshParts(mesh: IMesh, colours: Record<string, string>, glyphs: Record<string, string>): IContainer {
    const name = esc(mesh.name);
    const open = !this._collapsed.has(mesh.name);
    const meta = [mesh.kind, shapeText(mesh.shape), mesh.dist === 'none' ? 'no dist' : mesh.dist]
      .map(esc)
      .join(' \u00b7 ');
    const up = mesh.state === 'up';
    const data = { mesh: mesh.name };
    const toggle = open ? caretDownIcon : caretRightIcon;
    const parts: (IPart | IContainer)[] = [
      {
        key: 'head',
        html:
          `<div class="mk-mesh-head"><button class="mk-toggle" data-action="toggle" data-mesh="${name}" ` +
          `aria-expanded="${open}" title="Show or hide the ranks">${toggle.svgstr}</button>` +
          `<span class="mk-name">${name}</span>${mesh.default ? '<span class="mk-badge">default</span>' : ''}` +
          `<span class="mk-mesh-state">${esc(mesh.state)}</span></div>`
      },
      { key: 'meta', html: `<div class="mk-meta">${meta}</div>` },
      {
        key: 'counts',
        html: `<div class="mk-counts" title="the mesh's ranks">${mesh.ranks.length} ranks: ${esc(summary(mesh.ranks))}</div>`
      }
    ];
    if (mesh.allocation) {
      const short = mesh.allocation.includes('less than 10 minutes left');
      parts.push({
        key: 'allocation',
        html: `<div class="mk-allocation${short ? ' mk-warn' : ''}" title="the Slurm job">${esc(mesh.allocation)}</div>`
      });
    }
    if (mesh.hosts.length && !(open && mesh.ranks.length)) {  // else each host heads its own section
      parts.push({ key: 'hosts', html: `<div class="mk-hosts" title="hosts">${mesh.hosts.map(esc).join(', ')}</div>` });
    }
    parts.push({
      key: 'actions',
      html:
        '<div class="mk-actions">' +
        iconButton(stopIcon, 'interrupt', 'Interrupt', 'Interrupt what runs on every rank', data, up) +
        iconButton(refreshIcon, 'restart', 'Restart', 'A fresh mesh of the same shape (namespaces are lost)', data,
                   up) +
        iconButton(closeIcon, 'down', 'Down', 'Stop every rank of this mesh', data, up) +
        iconButton(searchIcon, 'why', 'Why?', 'Which rank waits in which collective for whom, and where each is',
                   data, up) +
        iconButton(addIcon, 'insert', 'Cell', `Insert a %%mesh --name ${mesh.name} cell below the active one`,
                   data, up) +
        '</div>'
    });
    if (open && mesh.ranks.length) {
      const hosts = byHost(mesh);
      parts.push({
        key: 'hosts-grid',
        tag: 'div',
        attributes: { class: 'mk-host-list' },
        parts: hosts.map(([host, ranks]) => this._hostParts(mesh, host, ranks, hosts.length, colours, glyphs))
      });
    }
    const why = this._why;
    if (why && why.mesh === mesh.name) {
      parts.push({
        key: 'why',
        html:
          '<div class="mk-logs mk-why"><div class="mk-logs-head">why ' +
          '<button class="mk-button" data-action="close-why">Close</button></div>' +
          `<pre>${esc(why.text)}</pre></div>`
      });
    }
    const logs = this._logs;
    if (logs && logs.mesh === mesh.name) {
      const lines = logs.lines.length
        ? logs.lines.map(([stream, line]) => `<span class="mk-${esc(stream)}">${esc(line)}</span>`).join('\n')
        : '(nothing printed yet)';
      parts.push({
        key: 'logs',
        html:
          `<div class="mk-logs" data-rank="${logs.rank}"><div class="mk-logs-head">rank ${logs.rank}: last lines ` +
          '<button class="mk-button" data-action="close-logs">Close</button></div>' +
          '<div class="mk-debug-choice">' +
          (mesh.debugged === logs.rank
            ? `${bugIcon.svgstr}<span>JupyterLab's debugger stops in this rank</span>`
            : `<button class="mk-button" data-action="debug" data-mesh="${esc(mesh.name)}" data-rank="${logs.rank}" ` +
              'title="JupyterLab\'s debugger (when on) stops in this rank at %%mesh cells\' breakpoints">' +
              `${bugIcon.svgstr} Debug this rank</button>`) +
          '</div>' +
          `<pre>${lines}</pre></div>`
      });
    }
    return {
      key: `mesh:${mesh.name}`,
      tag: 'section',
      attributes: { class: 'mk-mesh', 'data-mesh': mesh.name, 'data-state': mesh.state },
      parts
    };
  }

  /** One host: its name and summary line, and (unfolded) a tile per rank, GPU by GPU. */
  private _hostParts(mesh: IMesh, host: string, ranks: IRank[], hostCount: number, colours: Record<string, string>,
                     glyphs: Record<string, string>): IContainer {
    const key = `${mesh.name}\u0000${host}`;
    const open = this._hostOpen.get(key) ?? hostCount <= FOLD_HOSTS;
    const toggle = open ? caretDownIcon : caretRightIcon;
    const parts: (IPart | IContainer)[] = [
      {
        key: 'head',
        html:
          `<div class="mk-host-head"><button class="mk-toggle" data-action="toggle-host" data-mesh="${esc(mesh.name)}" ` +
          `data-host="${esc(host)}" aria-expanded="${open}" title="Show or hide this host's ranks">` +
          `${toggle.svgstr}</button><span class="mk-host-name">${esc(host)}</span>` +
          `<span class="mk-host-summary">${esc(summary(ranks))}</span></div>`
      }
    ];
    if (open) {
      parts.push({
        key: 'grid',
        tag: 'div',
        attributes: { class: 'mk-grid' },
        parts: ranks.map(r => ({ key: String(r.rank), html: this._rankHtml(mesh, r, colours, glyphs) }))
      });
    }
    return { key: `host:${host}`, tag: 'div', attributes: { class: 'mk-host', 'data-host': host }, parts };
  }

  private _rankHtml(mesh: IMesh, r: IRank, colours: Record<string, string>, glyphs: Record<string, string>): string {
    const where = Object.entries(r.coords)
      .map(([dim, i]) => `${dim}=${i}`)
      .join(' ');
    const title = `rank ${r.rank} (${where}) on ${r.host}, pid ${r.pid ?? '-'}: ${r.state}` +
      `${r.detail ? ` \u2014 ${r.detail}` : ''}\nClick for its recent output.`;
    const colour = colours[r.state];
    const loads: string[] = [];
    if (r.cpu !== null && r.cpu !== undefined) {
      const memory = r.mem_total ? (100 * (r.rss ?? 0)) / r.mem_total : null;
      loads.push(bar('cpu', r.cpu, `${r.cpu.toFixed(0)}%`), bar('mem', memory, bytesText(r.rss)));
    }
    if (r.gpu_total) {
      const used = r.gpu_used ?? 0;
      loads.push(bar('gpu', (100 * used) / r.gpu_total, `${bytesText(used)}/${bytesText(r.gpu_total)}`),
                 bar('util', r.gpu_util ?? 0, `${(r.gpu_util ?? 0).toFixed(0)}%`));
    }
    // the state as a badge: glyph and word in white on the state's colour (readable in any theme,
    // and not told by colour alone), as in the notebook's mesh view
    return (
      `<div class="mk-rank mk-state-${esc(r.state)}" data-action="logs" data-mesh="${esc(mesh.name)}" ` +
      `data-rank="${r.rank}" data-state="${esc(r.state)}" title="${esc(title)}"` +
      `${colour ? ` style="border-left-color:${esc(colour)}"` : ''}>` +
      `<div class="mk-rank-top"><span class="mk-rank-id">GPU ${r.local_rank ?? '?'} \u00b7 r${r.rank}` +
      (mesh.debugged === r.rank
        ? `<span class="mk-rank-debugged" title="JupyterLab's debugger stops in this rank">${bugIcon.svgstr}</span>`
        : '') +
      '</span>' +
      `<span class="mk-rank-state"${colour ? ` style="background:${esc(colour)}"` : ''}>` +
      `${esc(glyphs[r.state] ?? '?')} ${esc(r.state)}</span></div>` +
      `<div class="mk-rank-detail">${esc(r.detail || `pid ${r.pid ?? '-'}`)}</div>` +
      `<div class="mk-rank-load">${loads.join(' ')}</div></div>`
    );
  }

  private _onClick(event: MouseEvent): void {
    const target = (event.target as HTMLElement).closest('[data-action]') as HTMLElement | null;
    if (!target || (target as HTMLButtonElement).disabled) {
      return;
    }
    const action = target.dataset.action;
    const mesh = target.dataset.mesh ?? '';
    switch (action) {
      case 'refresh':
        this._link?.refresh();
        break;
      case 'toggle':
        if (!this._collapsed.delete(mesh)) {
          this._collapsed.add(mesh);
        }
        this._render();
        break;
      case 'toggle-host': {
        const key = `${mesh}\u0000${target.dataset.host ?? ''}`;
        const shown = target.getAttribute('aria-expanded') === 'true';
        this._hostOpen.set(key, !shown);
        this._render();
        break;
      }
      case 'close-logs':
        this._logs = null;
        this._render();
        break;
      case 'close-why':
        this._why = null;
        this._render();
        break;
      case 'why':
        this._ask('why', mesh, `Asking the ranks of mesh ${mesh} where they are\u2026`);
        break;
      case 'interrupt':
        this._interrupt(mesh);
        break;
      case 'restart':
        this._ask('restart', mesh, `Restarting mesh ${mesh}\u2026`);
        break;
      case 'down':
        void this._down(mesh);
        break;
      case 'logs':
        this._ask('logs', mesh, `Asking rank ${target.dataset.rank} for its output\u2026`, {
          rank: Number(target.dataset.rank),
          lines: LOG_LINES
        });
        break;
      case 'debug':
        this._ask('debug', mesh, `Choosing rank ${target.dataset.rank} for JupyterLab's debugger\u2026`, {
          rank: Number(target.dataset.rank)
        });
        break;
      case 'insert':
        this._insertCell(mesh);
        break;
    }
  }

  /** Send an action; say so when the kernel is busy and cannot hear it before the cell ends. */
  private _ask(action: Action, mesh: string, pending: string,
               extra: Record<string, number> = {}): void {
    const link = this._link;
    if (!link || !link.act(action, mesh, extra)) {
      this._setStatus('No link to the kernel: press Refresh.', false);
      return;
    }
    const kernel = link.kernel;
    const queued = kernel && kernel.status === 'busy' && !kernel.supportsSubshells;
    this._setStatus(queued ? `${pending} (the kernel is busy: it acts when the running cell ends)` : pending);
  }

  private _interrupt(mesh: string): void {
    const kernel = this._link?.kernel;
    if (kernel && kernel.status === 'busy' && !kernel.supportsSubshells) {
      // A kernel without subshells reads no comm message while a cell runs; interrupting the
      // kernel ends a running %%mesh cell, and the magic interrupts the mesh's ranks.
      void kernel.interrupt();
      this._setStatus(`Interrupted the kernel's running cell (the kernel was busy).`);
      return;
    }
    this._ask('interrupt', mesh, `Interrupting mesh ${mesh}\u2026`);
  }

  private async _down(mesh: string): Promise<void> {
    const answer = await showDialog({
      title: `Bring mesh ${mesh} down?`,
      body: 'Every rank of the mesh stops, and what its namespaces hold is lost.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Bring down' })]
    });
    if (answer.button.accept) {
      this._ask('down', mesh, `Bringing mesh ${mesh} down\u2026`);
    }
  }

  private _insertCell(mesh: string): void {
    const notebook = this._notebook;
    if (!notebook) {
      return;
    }
    NotebookActions.insertBelow(notebook.content);
    const cell = notebook.content.activeCell;
    if (cell) {
      cell.model.sharedModel.setSource(`%%mesh --name ${mesh}\n`);
    }
    this._focus(notebook);
    notebook.content.mode = 'edit';
    cell?.editor?.setCursorPosition({ line: 1, column: 0 });
  }

  private _onResult(result: IResultMessage): void {
    if (result.action === 'logs' && result.ok && result.mesh !== undefined && result.rank !== undefined) {
      this._logs = { mesh: result.mesh, rank: result.rank, lines: result.logs ?? [] };
      this._render();
    }
    if (result.action === 'why' && result.ok && result.mesh !== undefined) {
      this._why = { mesh: result.mesh, text: result.why ?? '' };
      this._render();
    }
    this._setStatus(result.message, result.ok);
  }

  private _notebook: NotebookPanel | null = null;
  private _link: MeshLink | null = null;
  private _collapsed = new Set<string>();
  private _hostOpen = new Map<string, boolean>(); // hosts the user folded or unfolded, by mesh and name
  private _logs: IShownLogs | null = null;
  private _why: { mesh: string; text: string } | null = null; // the last verdict asked for, shown under its mesh
}
